"""The trainer scripts an HF/TRL bundle carries (`kiln train hf export-sft`, `export-grpo`): each runs
unchanged on a machine with Transformers, TRL and PEFT, checks what it reads against the bundle's
manifest first, and writes adapter/ with a manifest of its own that `kiln train hf import-peft`
checks."""

# what both scripts share (each bundle carries one script, whole: it must run on its own)
_HELPERS = '''import argparse
import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checked(manifest, name):
    path = os.path.join(HERE, name)
    if sha256(path) != manifest["files"][name]["sha256"]:
        raise SystemExit(name + " does not match the bundle's manifest: refusing to train with it")
    return path


def arguments():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-steps", type=int, default=-1)
    ap.add_argument("--output", default=os.path.join(HERE, "adapter"))
    return ap.parse_args(), json.load(open(os.path.join(HERE, "manifest.json")))


def lora(o):
    from peft import LoraConfig
    return LoraConfig(r=o["rank"], lora_alpha=o["alpha"], lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def finish(trainer, output, manifest):
    """Save the adapter and a manifest of its files (what import-peft checks)."""
    trainer.model.save_pretrained(output)
    files = {n: {"bytes": os.path.getsize(os.path.join(output, n)), "sha256": sha256(os.path.join(output, n))}
             for n in ("adapter_config.json", "adapter_model.safetensors")}
    with open(os.path.join(output, "manifest.json"), "w") as f:
        json.dump({"format": manifest["format"], "kind": "peft-adapter", "hf_model": manifest["hf_model"],
                   "files": files}, f, indent=2, sort_keys=True)
    print("wrote", output)
'''

SFT_SCRIPT = '''#!/usr/bin/env python3
"""LoRA SFT of the bundle's model on its dataset.jsonl with Transformers + TRL + PEFT (a Kiln
HF/TRL bundle). On a machine with a GPU:

    pip install "trl>=0.12" "peft>=0.13" datasets transformers torch
    python train_trl.py                  # --max-steps N for a short run

Writes adapter/ (adapter_config.json, adapter_model.safetensors) and adapter/manifest.json with
each file's size and sha256; copy the bundle folder back and run
`kiln train hf import-peft --bundle FOLDER --name NAME`.
"""
''' + _HELPERS + '''

def main():
    args, manifest = arguments()
    data = checked(manifest, "dataset.jsonl")
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer
    o = manifest["options"]
    trainer = SFTTrainer(
        model=manifest["hf_model"],
        train_dataset=load_dataset("json", data_files=data, split="train"),
        args=SFTConfig(output_dir=os.path.join(HERE, "trl-out"), num_train_epochs=o["epochs"],
                       learning_rate=o["lr"], per_device_train_batch_size=1, max_steps=args.max_steps,
                       seed=o["seed"], report_to=[], save_strategy="no"),
        peft_config=lora(o))
    trainer.train()
    finish(trainer, args.output, manifest)


if __name__ == "__main__":
    main()
'''

GRPO_SCRIPT = '''#!/usr/bin/env python3
"""GRPO of the bundle's model with Transformers + TRL + PEFT (a Kiln HF/TRL bundle): TRL samples
num_generations completions of each prompt in dataset.jsonl and rewards each with the example's
Kiln scorer (kiln_scoring.py: Kiln's own scoring module, byte for byte), so a reward here is the
score `kiln eval run` gives. On a machine with a GPU:

    pip install "trl>=0.14" "peft>=0.13" datasets transformers torch
    python train_trl.py                  # --max-steps N for a short run

Writes adapter/ and adapter/manifest.json; copy the bundle back and run
`kiln train hf import-peft --bundle FOLDER --name NAME`.
"""
''' + _HELPERS + '''

def reward(completions, example, scorer, **_):
    """TRL's reward function: each completion scored as `kiln eval run` scores it."""
    sys.path.insert(0, HERE)
    import kiln_scoring
    out = []
    for c, ex, sc in zip(completions, example, scorer):
        text = c[-1]["content"] if isinstance(c, list) else c
        out.append(float(kiln_scoring.score(text, ex, sc).score))
    return out


def main():
    args, manifest = arguments()
    data = checked(manifest, "dataset.jsonl")
    checked(manifest, "kiln_scoring.py")
    from datasets import load_dataset
    from trl import GRPOConfig, GRPOTrainer
    o = manifest["options"]
    trainer = GRPOTrainer(
        model=manifest["hf_model"], reward_funcs=reward,
        train_dataset=load_dataset("json", data_files=data, split="train"),
        args=GRPOConfig(output_dir=os.path.join(HERE, "trl-out"), num_train_epochs=o["epochs"],
                        learning_rate=o["lr"], num_generations=o["num_generations"],
                        per_device_train_batch_size=o["num_generations"],
                        max_completion_length=o["max_new_tokens"], beta=o["beta"], temperature=o["temperature"],
                        max_steps=args.max_steps, seed=o["seed"], report_to=[], save_strategy="no"),
        peft_config=lora(o))
    trainer.train()
    finish(trainer, args.output, manifest)


if __name__ == "__main__":
    main()
'''

"""PEFT adapters in and out (fast tier): export then import gives bit-identical GGUF tensors —
so an imported adapter is the very adapter llama.cpp loaded for tests/data/lora_llamacpp — the
q/k row permutation matches the GGUF converter's, element by element, on known matrices, and
everything a GGUF LoRA cannot hold is refused by name."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import DATA
from kiln.native.lora import AdapterError
from kiln.native.training.peft import export_peft, import_peft
from test_lora_interop import interop_adapter, tensor_hash


def test_export_then_import_is_bit_identical_and_is_what_llama_cpp_loaded(default_model, tmp_path):
    c = default_model.config
    ad = interop_adapter(default_model)
    folder = export_peft(ad, tmp_path / "peft", c.n_head, c.n_head_kv, "SmolLM2")
    cfg = json.loads((folder / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 16 and cfg["lora_alpha"] == 32.0
    assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    back = import_peft(folder, "llama", c.n_head, c.n_head_kv)
    assert back.alpha == ad.alpha and back.rank == ad.rank
    assert tensor_hash(back) == tensor_hash(ad)
    ref = json.loads((DATA / "lora_llamacpp.json").read_text())
    assert tensor_hash(back) == ref["adapter_tensor_sha256"]      # the adapter llama.cpp's own loader took


def test_known_matrices_land_where_the_gguf_converter_puts_q_and_k_rows(tmp_path):
    from safetensors.numpy import save_file
    n_head, n_head_kv, hd, n_in, r = 4, 2, 8, 32, 2
    rng = np.random.default_rng(0)
    mats = {}
    for proj, rows in (("q_proj", n_head * hd), ("k_proj", n_head_kv * hd), ("v_proj", n_head_kv * hd)):
        a, b = rng.normal(size=(r, n_in)).astype(np.float32), rng.normal(size=(rows, r)).astype(np.float32)
        mats[proj] = (a, b)
    save_file({f"base_model.model.model.layers.0.self_attn.{p}.lora_{x}.weight": m
               for p, (a, b) in mats.items() for x, m in (("A", a), ("B", b))}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 4}))
    ad = import_peft(tmp_path, "llama", n_head, n_head_kv)
    assert ad.scale == 2.0
    for proj, target, heads in (("q_proj", "attn_q", n_head), ("k_proj", "attn_k", n_head_kv)):
        a, b = mats[proj]
        ga, gb = ad.tensors[f"blk.0.{target}.weight"]
        assert np.array_equal(ga, a)                       # A is untouched
        for h in range(heads):                              # HF row h*hd + c*hd/2 + i -> GGUF h*hd + 2i + c
            for i in range(hd // 2):
                for c in range(2):
                    assert np.array_equal(gb[h * hd + 2 * i + c], b[h * hd + c * (hd // 2) + i])
        # dW = B A permutes as the base weight's rows do
        assert np.array_equal(gb @ ga, (b @ a).reshape(heads, 2, hd // 2, n_in).swapaxes(1, 2).reshape(-1, n_in))
    assert np.array_equal(ad.tensors["blk.0.attn_v.weight"][1], mats["v_proj"][1])   # v: no permutation
    qwen = import_peft(tmp_path, "qwen2", n_head, n_head_kv)                         # qwen: none either
    assert np.array_equal(qwen.tensors["blk.0.attn_q.weight"][1], mats["q_proj"][1])


@pytest.mark.parametrize("cfg, words", [({"peft_type": "LORA", "r": 2, "use_dora": True}, "use_dora"),
                                        ({"peft_type": "LORA", "r": 2, "bias": "all"}, "bias"),
                                        ({"peft_type": "IA3"}, "peft_type"),
                                        ({"peft_type": "LORA", "r": 3}, "rank")])
def test_what_a_gguf_lora_cannot_hold_is_refused(tmp_path, cfg, words):
    from safetensors.numpy import save_file
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 8), np.float32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": np.zeros((8, 2), np.float32)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(AdapterError, match=words):
        import_peft(tmp_path, "llama", 2, 2)


def test_unknown_tensors_are_refused(tmp_path):
    from safetensors.numpy import save_file
    save_file({"base_model.model.lm_head.lora_A.weight": np.zeros((2, 8), np.float32)},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2}')
    with pytest.raises(AdapterError, match="lm_head"):
        import_peft(tmp_path, "llama", 2, 2)


def test_cli_import_and_export(default_model, default_model_path, tmp_path):
    from kiln.supervisor.cli.main import app
    c = default_model.config
    export_peft(interop_adapter(default_model), tmp_path / "in", c.n_head, c.n_head_kv)
    env = {"KILN_HOME": str(tmp_path / "home")}
    r = CliRunner().invoke(app, ["adapters", "import", str(tmp_path / "in"), "--name", "imported",
                                 "--model", str(default_model_path)], env=env)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "home" / "adapters" / "imported.gguf").is_file()
    r = CliRunner().invoke(app, ["adapters", "import", str(tmp_path / "in"), "--name", "imported",
                                 "--model", str(default_model_path)], env=env)
    assert r.exit_code != 0 and "exists" in r.output
    r = CliRunner().invoke(app, ["adapters", "export", "imported", "--peft", str(tmp_path / "out")], env=env)
    assert r.exit_code == 0, r.output
    from safetensors.numpy import load_file
    a, b = load_file(str(tmp_path / "in" / "adapter_model.safetensors")), load_file(str(tmp_path / "out" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_peft_adapter_of_known_matrices_changes_the_logits_as_those_matrices_in_numpy(tmp_path):
    """Logits with the imported adapter == logits of the base model whose q/k/v weights had the
    HF-order product B A added in numpy, rows moved to GGUF order by an explicit index formula."""
    import copy

    from safetensors.numpy import save_file

    from kiln.native.model import load_model
    from kiln.native.training.lora_grad import FrozenBase, loss_and_grads
    m = load_model(DATA / "tiny" / "tiny-llama.gguf")
    c = m.config
    hd, r, alpha = c.head_dim, 4, 8.0
    rng = np.random.default_rng(5)
    hf = {}
    for layer in range(c.n_layer):
        for proj, heads in (("q_proj", c.n_head), ("k_proj", c.n_head_kv), ("v_proj", c.n_head_kv)):
            hf[(layer, proj)] = (rng.normal(0, 0.2, size=(r, c.n_embd)), rng.normal(0, 0.2, size=(heads * hd, r)))
    save_file({f"base_model.model.model.layers.{layer}.self_attn.{proj}.lora_{x}.weight": mat.astype(np.float32)
               for (layer, proj), (a, b) in hf.items() for x, mat in (("A", a), ("B", b))},
              str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": alpha}))
    ad = import_peft(tmp_path, "llama", c.n_head, c.n_head_kv)

    base = FrozenBase(m, np.float64)
    tokens = rng.integers(0, 200, size=12)
    targets = list(range(1, 12))

    def logp(fb, lora):
        got = {}

        def keep(lp):
            got["lp"] = lp
            return np.zeros_like(lp), 0.0
        loss_and_grads(fb, lora, alpha / r, tokens, targets, {}, keep)
        return got["lp"]
    with_adapter = logp(base, {n: (a.astype(np.float64), b.astype(np.float64)) for n, (a, b) in ad.tensors.items()})

    merged = copy.deepcopy(base)
    for L, (layer) in zip(merged.layers, range(c.n_layer)):
        for proj, key, permuted in (("q_proj", "attn_q", True), ("k_proj", "attn_k", True), ("v_proj", "attn_v", False)):
            a, b = hf[(layer, proj)]
            dw_hf = (alpha / r) * (b.astype(np.float32).astype(np.float64) @ a.astype(np.float32).astype(np.float64))
            dw = np.empty_like(dw_hf)
            if permuted:
                for row in range(dw_hf.shape[0]):            # GGUF row h*hd + 2i + c <- HF row h*hd + c*hd/2 + i
                    h, rest = divmod(row, hd)
                    i, cc = divmod(rest, 2)
                    dw[row] = dw_hf[h * hd + cc * (hd // 2) + i]
            else:
                dw = dw_hf
            L.w[key] = L.w[key] + dw
    plain = logp(merged, {})
    assert not np.allclose(plain, logp(base, {}), atol=1e-3)    # the adapter matters
    assert np.allclose(with_adapter, plain, rtol=0, atol=1e-9), np.max(np.abs(with_adapter - plain))

"""tests/data/vision/: tiny random-weight vision models (mmproj GGUFs under clip.cpp's tensor names,
written with gguf-py), their text models, test images, and llama.cpp's own mtmd answers for them.

- `tiny-smolvlm.gguf` — tiny-llama's weights with unused tokens renamed to SmolVLM's image tokens
  (`<fake_token_around_image>`, `<global-img>`, `<row_R_col_C>`, "\\n\\n"); `mmproj-tiny-smolvlm.gguf` —
  an idefics3 projector: a SigLIP ViT (2 layers, 64 wide, 4 heads, patch 8, tiles of 32 pixels,
  longest edge 64: up to 2×2 tiles and an overview), pixel shuffle by 2, one linear map to 128.
- `tiny-gemma3v.gguf` — tiny-gemma3 with `<start_of_image>`/`<end_of_image>`; `mmproj-tiny-gemma3.gguf`
  — a gemma3 projector: the ViT at 32 pixels, patch 4, 2×2 average pooling, RMS norm, projection.
- `tiny-qwen25vl.gguf` — tiny-qwen2 as the `qwen2vl` architecture (M-RoPE sections 4/6/6 of its
  16 rotated pairs) with `<|vision_start|>`/`<|vision_end|>`; `mmproj-tiny-qwen25vl.gguf` — a
  qwen2.5vl_merger projector: patch 14 (two temporal kernels), 4 layers 64 wide, window attention
  in layers 0 and 2 (windows of 112 pixels), SwiGLU, RMS norms, the 2×2 merger MLP to 128.
- `tiny-qwen3vl.gguf` — tiny-qwen3 as `qwen3vl` (interleaved M-RoPE 6/4/4/0, 2 deepstack layers);
  `mmproj-tiny-qwen3vl.gguf` — a qwen3vl_merger projector: patch 16, a 4×4 learned position table,
  4 LayerNorm layers 64 wide, a fused qkv, GELU, deepstack mergers after layers 1 and 2.
- `cat.png` (40×28), `square.png` (32×32), `wide.png` (70×50): smooth gradients with noise;
  `large.png` (300×200, the Qwen models only: 22×14 patches of 14, six attention windows).

`references.json`/`.npz`: for each (model, image) llama.cpp's mtmd (llama-cpp-python 0.3.36, its
libmtmd, 2 threads, flash attention off): the chunks of the tokenized prompt (text ids, image token
counts), each image chunk's embeddings, the logits after the prompt, 8 greedy tokens.

    python tests/tools/make_tiny_vision.py
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFWriter

HERE = Path(__file__).resolve().parent.parent
TINY = HERE / "data" / "tiny"
OUT = HERE / "data" / "vision"
MARKER = "<__media__>"

SMOLVLM_TOKENS = ["<fake_token_around_image>", "<global-img>", "<image>", "ĊĊ"] + [
    f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)]
GEMMA_TOKENS = ["<start_of_image>", "<end_of_image>"]
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
QWEN_SECTIONS = [4, 6, 6, 0]             # Qwen2.5-VL's 16/24/24 of 64 pairs, for 16 pairs
QWEN3_SECTIONS = [6, 4, 4, 0]            # interleaved as Qwen3-VL's 24/20/20 of 64: two pairs left at position 0
PROMPTS = {
    "tiny-smolvlm": f"<|im_start|>user\n{MARKER}the cat<|im_end|>\n<|im_start|>assistant\n",
    "tiny-gemma3v": f"<|im_start|>user\n{MARKER}the cat<|im_end|>\n<|im_start|>assistant\n",
    "tiny-qwen25vl": f"<|im_start|>user\n{MARKER}the cat<|im_end|>\n<|im_start|>assistant\n",
    "tiny-qwen3vl": f"<|im_start|>user\n{MARKER}the cat<|im_end|>\n<|im_start|>assistant\n",
}


def text_model(src: str, out: str, tokens: list[str], arch: str | None = None, meta: dict | None = None) -> Path:
    """`src` with its unused control tokens renamed to `tokens` ("ĊĊ" a normal token: mtmd looks
    "\\n\\n" up by its text); `arch`: its architecture renamed (its keys with it)."""
    sys.path.insert(0, str(HERE))
    from gguf_copy import copy_gguf
    r = GGUFReader(TINY / f"{src}.gguf")
    f = r.fields["tokenizer.ggml.tokens"]
    vocab = [bytes(f.parts[i]).decode() for i in f.data]
    types = list(r.fields["tokenizer.ggml.token_type"].contents())
    free = [i for i, t in enumerate(vocab) if t.startswith("<|unused")]
    for i, t in zip(free, tokens):
        vocab[i], types[i] = t, (1 if t == "ĊĊ" else 3)
    old = r.fields["general.architecture"].contents()
    rename = (lambda k: arch + k[len(old):] if k.startswith(old + ".") else k) if arch else None
    return copy_gguf(TINY / f"{src}.gguf", OUT / f"{out}.gguf", arch, rename=rename,
                     meta={"tokenizer.ggml.tokens": vocab, "tokenizer.ggml.token_type": types,
                           "general.name": out} | (meta or {}))


def random_tensors(w: GGUFWriter, rng):
    """mat(name, *shape): F16 of about unit-norm rows; vec(name, n, base, scale): F32 near base."""
    def mat(name, *shape, scale=None):
        a = rng.standard_normal(shape).astype(np.float32) * (scale or shape[-1] ** -0.5)
        w.add_tensor(name, a.astype(np.float16), raw_dtype=T.F16)

    def vec(name, n, base=0.0, scale=0.1):
        w.add_tensor(name, (base + scale * rng.standard_normal(n)).astype(np.float32))
    return mat, vec


def mmproj(path: Path, projector: str, *, image_size: int, patch: int, merge: int, n_text: int,
           seed: int, extra: dict, n_embd: int = 64, n_ff: int = 96, n_head: int = 4, n_layer: int = 2) -> Path:
    """A random-weight projector of this shape (bench/vision.py writes real models' shapes with it)."""
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), "clip")
    w.add_string("general.name", path.stem)
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.embedding_length", n_embd)
    w.add_uint32("clip.vision.feed_forward_length", n_ff)
    w.add_uint32("clip.vision.block_count", n_layer)
    w.add_uint32("clip.vision.projection_dim", n_text)
    w.add_uint32("clip.vision.attention.head_count", n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", patch)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_uint32("clip.vision.projector.scale_factor", merge)
    for k, v in extra.items():
        w.add_uint32(k, v)

    mat, vec = random_tensors(w, rng)
    n_pos = (image_size // patch) ** 2
    mat("v.patch_embd.weight", n_embd, 3, patch, patch, scale=(3 * patch * patch) ** -0.5)
    vec("v.patch_embd.bias", n_embd)
    w.add_tensor("v.position_embd.weight", (0.2 * rng.standard_normal((n_pos, n_embd))).astype(np.float32))
    for i in range(n_layer):
        for p in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(f"v.blk.{i}.{p}.weight", n_embd, n_embd)
            vec(f"v.blk.{i}.{p}.bias", n_embd)
        for p in ("ln1", "ln2"):
            vec(f"v.blk.{i}.{p}.weight", n_embd, 1.0)
            vec(f"v.blk.{i}.{p}.bias", n_embd)
        mat(f"v.blk.{i}.ffn_up.weight", n_ff, n_embd)
        vec(f"v.blk.{i}.ffn_up.bias", n_ff)
        mat(f"v.blk.{i}.ffn_down.weight", n_embd, n_ff)
        vec(f"v.blk.{i}.ffn_down.bias", n_embd)
    vec("v.post_ln.weight", n_embd, 1.0)
    vec("v.post_ln.bias", n_embd)
    if projector == "idefics3":
        mat("mm.model.fc.weight", n_text, n_embd * merge * merge)
    else:
        vec("mm.soft_emb_norm.weight", n_embd, 1.0)
        mat("mm.input_projection.weight", n_embd, n_text, scale=n_embd ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def clip_writer(path: Path, projector: str, act: str, sizes: dict, mean: list, std: list) -> GGUFWriter:
    """A clip GGUF's writer with its keys: the projector, the FFN's activation, the vision sizes."""
    w = GGUFWriter(str(path), "clip")
    w.add_string("general.name", path.stem)
    w.add_string("clip.projector_type", projector)
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool(f"clip.use_{act}", True)
    for k, v in sizes.items():
        w.add_uint32(f"clip.vision.{k}", v)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_array("clip.vision.image_mean", mean)
    w.add_array("clip.vision.image_std", std)
    return w


def merger_and_write(w: GGUFWriter, mat, vec, n_embd: int, n_text: int) -> None:
    """The 2×2 merger MLP (mm.0, mm.2), then the file written."""
    mat("mm.0.weight", 4 * n_embd, 4 * n_embd)
    vec("mm.0.bias", 4 * n_embd)
    mat("mm.2.weight", n_text, 4 * n_embd)
    vec("mm.2.bias", n_text)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def mmproj_qwen25vl(path: Path, *, n_text: int, seed: int, n_embd: int = 64, n_ff: int = 96, n_head: int = 4,
                    n_layer: int = 4, patch: int = 14, wa_pattern: int = 2) -> Path:
    """A random-weight Qwen2.5-VL projector (clip.cpp's qwen2.5vl_merger): two patch kernels (the
    temporal pair, summed for a still image), RMS norms, SwiGLU FFNs with biases, window attention
    but every `wa_pattern`-th layer, the 2×2 merger MLP."""
    rng = np.random.default_rng(seed)
    w = clip_writer(path, "qwen2.5vl_merger", "silu",
                    {"embedding_length": n_embd, "feed_forward_length": n_ff, "block_count": n_layer,
                     "projection_dim": n_text, "attention.head_count": n_head, "image_size": 560, "patch_size": patch,
                     "n_wa_pattern": wa_pattern, "spatial_merge_size": 2},
                    [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])

    mat, vec = random_tensors(w, rng)
    mat("v.patch_embd.weight", n_embd, 3, patch, patch, scale=(6 * patch * patch) ** -0.5)
    mat("v.patch_embd.weight.1", n_embd, 3, patch, patch, scale=(6 * patch * patch) ** -0.5)
    for i in range(n_layer):
        for p in ("attn_q", "attn_k", "attn_v", "attn_out"):
            mat(f"v.blk.{i}.{p}.weight", n_embd, n_embd)
            vec(f"v.blk.{i}.{p}.bias", n_embd)
        for p in ("ln1", "ln2"):
            vec(f"v.blk.{i}.{p}.weight", n_embd, 1.0)
        for p in ("ffn_gate", "ffn_up"):
            mat(f"v.blk.{i}.{p}.weight", n_ff, n_embd)
            vec(f"v.blk.{i}.{p}.bias", n_ff)
        mat(f"v.blk.{i}.ffn_down.weight", n_embd, n_ff)
        vec(f"v.blk.{i}.ffn_down.bias", n_embd)
    vec("v.post_ln.weight", n_embd, 1.0)
    merger_and_write(w, mat, vec, n_embd, n_text)
    return path


def mmproj_qwen3vl(path: Path, *, n_text: int, seed: int, n_embd: int = 64, n_ff: int = 96, n_head: int = 4,
                   n_layer: int = 4, patch: int = 16, image_size: int = 64, deepstack=(1, 2)) -> Path:
    """A random-weight Qwen3-VL projector (clip.cpp's qwen3vl_merger): two patch kernels and a patch
    bias, learned position embeddings for an image_size square (resized bilinearly to the image's
    patches), LayerNorms, a fused qkv, GELU FFNs, deepstack mergers after `deepstack` layers, the
    2×2 merger MLP."""
    rng = np.random.default_rng(seed)
    w = clip_writer(path, "qwen3vl_merger", "gelu",
                    {"embedding_length": n_embd, "feed_forward_length": n_ff, "block_count": n_layer,
                     "projection_dim": n_text, "attention.head_count": n_head, "image_size": image_size,
                     "patch_size": patch, "spatial_merge_size": 2}, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    w.add_array("clip.vision.is_deepstack_layers", [i in deepstack for i in range(n_layer)])
    mat, vec = random_tensors(w, rng)
    mat("v.patch_embd.weight", n_embd, 3, patch, patch, scale=(6 * patch * patch) ** -0.5)
    mat("v.patch_embd.weight.1", n_embd, 3, patch, patch, scale=(6 * patch * patch) ** -0.5)
    vec("v.patch_embd.bias", n_embd)
    w.add_tensor("v.position_embd.weight",
                 (0.2 * rng.standard_normal(((image_size // patch) ** 2, n_embd))).astype(np.float32))
    for i in range(n_layer):
        mat(f"v.blk.{i}.attn_qkv.weight", 3 * n_embd, n_embd)
        vec(f"v.blk.{i}.attn_qkv.bias", 3 * n_embd)
        mat(f"v.blk.{i}.attn_out.weight", n_embd, n_embd)
        vec(f"v.blk.{i}.attn_out.bias", n_embd)
        for p in ("ln1", "ln2"):
            vec(f"v.blk.{i}.{p}.weight", n_embd, 1.0)
            vec(f"v.blk.{i}.{p}.bias", n_embd)
        mat(f"v.blk.{i}.ffn_up.weight", n_ff, n_embd)
        vec(f"v.blk.{i}.ffn_up.bias", n_ff)
        mat(f"v.blk.{i}.ffn_down.weight", n_embd, n_ff)
        vec(f"v.blk.{i}.ffn_down.bias", n_embd)
        if i in deepstack:
            vec(f"v.deepstack.{i}.norm.weight", 4 * n_embd, 1.0)
            vec(f"v.deepstack.{i}.norm.bias", 4 * n_embd)
            mat(f"v.deepstack.{i}.fc1.weight", 4 * n_embd, 4 * n_embd)
            vec(f"v.deepstack.{i}.fc1.bias", 4 * n_embd)
            mat(f"v.deepstack.{i}.fc2.weight", n_text, 4 * n_embd)
            vec(f"v.deepstack.{i}.fc2.bias", n_text)
    vec("v.post_ln.weight", n_embd, 1.0)
    vec("v.post_ln.bias", n_embd)
    merger_and_write(w, mat, vec, n_embd, n_text)
    return path


def images() -> dict[str, Path]:
    from PIL import Image
    rng = np.random.default_rng(7)
    out = {}
    for name, (wd, ht) in {"cat": (40, 28), "square": (32, 32), "wide": (70, 50), "large": (300, 200)}.items():
        y, x = np.mgrid[0:ht, 0:wd]
        rgb = np.stack([x * 255 / wd, y * 255 / ht, (x + y) * 127 / (wd + ht) + 64], -1)
        rgb = np.clip(rgb + rng.normal(0, 24, rgb.shape), 0, 255).astype(np.uint8)
        out[name] = OUT / f"{name}.png"
        Image.fromarray(rgb, "RGB").save(out[name])
    return out


def mtmd_reference(model: Path, proj: Path, image: Path, prompt: str, n_greedy: int = 8) -> tuple[dict, dict]:
    import llama_cpp
    from llama_cpp import mtmd_cpp as M
    from PIL import Image
    llm = llama_cpp.Llama(str(model), n_ctx=512, n_threads=2, n_batch=512, logits_all=True, verbose=False)
    params = M.mtmd_context_params_default()
    params.use_gpu, params.n_threads, params.warmup = False, 2, False
    params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = M.mtmd_init_from_file(str(proj).encode(), llm.model, params)
    assert ctx, proj
    rgb = np.asarray(Image.open(image).convert("RGB"))
    buf = (ctypes.c_uint8 * rgb.size).from_buffer_copy(rgb.tobytes())
    bitmap = M.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], buf)
    text = M.mtmd_input_text()
    raw = prompt.encode()
    text.text, text.text_len, text.add_special, text.parse_special = raw, len(raw), True, True
    chunks = M.mtmd_input_chunks_init()
    assert M.mtmd_tokenize(ctx, chunks, ctypes.byref(text), (M.mtmd_bitmap_p_ctypes * 1)(bitmap), 1) == 0
    layout, arrays, n_embd = [], {}, llama_cpp.llama_model_n_embd_inp(llm.model)    # Qwen3-VL: and its deepstack rows
    llm.reset()
    for i in range(M.mtmd_input_chunks_size(chunks)):
        chunk = M.mtmd_input_chunks_get(chunks, i)
        if M.mtmd_input_chunk_get_type(chunk) == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
            n = ctypes.c_size_t()
            ptr = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
            ids = [ptr[j] for j in range(n.value)]
            layout.append({"text": ids})
            llm.eval(ids)
        else:
            n_tok = M.mtmd_input_chunk_get_n_tokens(chunk)
            assert M.mtmd_encode_chunk(ctx, chunk) == 0
            embd = M.mtmd_get_output_embd(ctx)
            arrays[f"image{len(arrays)}"] = np.ctypeslib.as_array(embd, shape=(n_tok * n_embd,)).reshape(n_tok, n_embd).copy()
            layout.append({"image": n_tok})
            past = llama_cpp.llama_pos(0)
            assert M.mtmd_helper_eval_chunk_single(ctx, llm._ctx.ctx, chunk, llm.n_tokens, 0, 512, False,
                                                   ctypes.byref(past)) == 0
            llm.n_tokens = past.value
    last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    arrays["last_logits"] = last
    greedy = []
    for _ in range(n_greedy):
        greedy.append(int(np.argmax(last)))
        llm.eval([greedy[-1]])
        last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    M.mtmd_input_chunks_free(chunks)
    M.mtmd_bitmap_free(bitmap)
    M.mtmd_free(ctx)
    return {"model": model.name, "mmproj": proj.name, "image": image.name, "prompt": prompt,
            "chunks": layout, "greedy_ids": greedy}, arrays


def main() -> None:
    import llama_cpp
    OUT.mkdir(exist_ok=True)
    pics = images()
    smol = text_model("tiny-llama", "tiny-smolvlm", SMOLVLM_TOKENS)
    gemma = text_model("tiny-gemma3", "tiny-gemma3v", GEMMA_TOKENS)
    p_smol = mmproj(OUT / "mmproj-tiny-smolvlm.gguf", "idefics3", image_size=32, patch=8, merge=2, n_text=128,
                    seed=1, extra={"clip.vision.preproc_image_size": 64})
    p_gemma = mmproj(OUT / "mmproj-tiny-gemma3.gguf", "gemma3", image_size=32, patch=4, merge=2, n_text=128,
                     seed=2, extra={})
    qwen = text_model("tiny-qwen2", "tiny-qwen25vl", QWEN_TOKENS, "qwen2vl",
                      {"qwen2vl.rope.dimension_sections": QWEN_SECTIONS})
    p_qwen = mmproj_qwen25vl(OUT / "mmproj-tiny-qwen25vl.gguf", n_text=128, seed=3)
    qwen3 = text_model("tiny-qwen3", "tiny-qwen3vl", QWEN_TOKENS, "qwen3vl",
                       {"qwen3vl.rope.dimension_sections": QWEN3_SECTIONS, "qwen3vl.n_deepstack_layers": 2})
    p_qwen3 = mmproj_qwen3vl(OUT / "mmproj-tiny-qwen3vl.gguf", n_text=128, seed=4)
    refs, arrays = {"llama_cpp_python": llama_cpp.__version__, "cases": []}, {}
    for model, proj in ((smol, p_smol), (gemma, p_gemma), (qwen, p_qwen), (qwen3, p_qwen3)):
        for name, image in pics.items():
            if name == "large" and model not in (qwen, qwen3):     # the windows of Qwen2.5-VL's attention
                continue
            ref, arr = mtmd_reference(model, proj, image, PROMPTS[model.stem])
            key = f"{model.stem}/{name}"
            ref["key"] = key
            refs["cases"].append(ref)
            arrays |= {f"{key}/{k}": v for k, v in arr.items()}
            print(key, [list(c.items())[0][0] + str(len(c["text"]) if "text" in c else c["image"]) for c in ref["chunks"]],
                  ref["greedy_ids"])
    (OUT / "references.json").write_text(json.dumps(refs, indent=1))
    np.savez(OUT / "references.npz", **arrays)


if __name__ == "__main__":
    main()

"""A GGUF copied with changes — what the hostile-file tests and the tiny-reference tools make:
metadata renamed (another architecture's keys) or replaced, tensors dropped or added."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter


def copy_gguf(src: Path, out: Path, arch: str | None = None, *, meta: dict | None = None, drop=(),
              add: dict | None = None, rename=None, drop_keys=()) -> Path:
    """`arch`: the copy's architecture (default the source's); `meta`: keys whose values change
    (by their name in the copy); `drop`: tensors left out; `add`: tensors added (name -> array);
    `rename(key) -> key`: each metadata key's name in the copy; `drop_keys`: keys left out."""
    r = GGUFReader(src)
    arch = arch or r.fields["general.architecture"].contents()
    w = GGUFWriter(str(out), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in drop_keys:
            continue
        name = rename(k) if rename else k
        v = meta[name] if meta and name in meta else f.contents()
        if k == "tokenizer.ggml.token_type":
            w.add_token_types(v)
        elif k == "tokenizer.ggml.precompiled_charsmap":
            w.add_precompiled_charsmap(bytes(v))
        elif f.types[0].name == "ARRAY" or isinstance(v, list):
            w.add_array(name, v)
        else:
            w.add_key_value(name, v, f.types[0])
    for k, v in (meta or {}).items():                     # keys the source does not have
        if k not in {rename(x) if rename else x for x in r.fields}:
            if isinstance(v, str):
                w.add_string(k, v)
            elif isinstance(v, list):
                w.add_array(k, v)
            elif isinstance(v, bool):
                w.add_bool(k, v)
            elif isinstance(v, float):
                w.add_float32(k, v)
            else:
                w.add_uint32(k, v)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, a in (add or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out

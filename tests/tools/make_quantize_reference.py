"""The quantizer's references: the sha256 of what llama.cpp's own quantizer (llama-cpp-python
0.3.36's `llama_model_quantize`, 2 threads) writes for each tiny model of tests/quant_models.py and
each file type Kiln writes, and of each input, into tests/data/quantize.json. The tests compare
Kiln's output with these (and with llama.cpp live where llama-cpp-python is installed).

    python tests/tools/make_quantize_reference.py
"""

import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(HERE))

from quant_models import INPUTS, llama_cpp_quantize  # noqa: E402

from kiln.native.models.quant_types import FILE_TYPES  # noqa: E402


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def main() -> None:
    import llama_cpp
    doc = {"made_with": f"llama-cpp-python {llama_cpp.__version__}: llama_model_quantize, nthread 2",
           "inputs": {}, "outputs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in INPUTS.items():
            src = make(Path(tmp) / f"{name}.gguf")
            doc["inputs"][name] = sha(src)
            for ft in FILE_TYPES:
                out = Path(tmp) / f"{name}.{ft}.gguf"
                llama_cpp_quantize(src, out, ft)
                doc["outputs"][f"{name}.{ft}"] = sha(out)
                out.unlink()
    (HERE / "data" / "quantize.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{len(doc['outputs'])} references")


if __name__ == "__main__":
    main()

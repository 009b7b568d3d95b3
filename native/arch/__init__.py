"""The architecture registry: one module per family (native/arch/*.py), each declaring its
hyperparameters, the tensors a layer needs, and its layer — a dataclass of the parts in
native/arch/parts.py and its own, each carrying its forward. `family(arch)` finds one; an
architecture not listed is refused with the list of those that are."""

from __future__ import annotations

from .base import Family
from .deepseek2 import DeepSeek2
from .ernie import Ernie45, Ernie45Moe
from .gemma3 import Gemma3
from .gpt_oss import GptOss
from .lfm2 import Lfm2
from .llama import Llama
from .phi3 import Phi3
from .qwen import Olmoe, Qwen2, Qwen2Moe, Qwen2VL, Qwen3, Qwen3Moe, Qwen3VL
from .qwen35 import Qwen35, Qwen35Moe
from .smollm3 import SmolLM3

FAMILIES: dict[str, Family] = {}
for _f in (Llama(), Qwen2(), Qwen2VL(), Qwen3(), Qwen3VL(), Qwen2Moe(), Qwen3Moe(), Olmoe(), Phi3(), Gemma3(), Qwen35(), Qwen35Moe(), GptOss(), SmolLM3(), Ernie45(),
           Ernie45Moe(), Lfm2(), DeepSeek2()):
    for _name in (_f.name, *_f.aliases):
        FAMILIES[_name] = _f


class UnknownArchitecture(KeyError):
    pass


def family(arch: str) -> Family:
    try:
        return FAMILIES[arch]
    except KeyError:
        raise UnknownArchitecture(arch) from None


def supported() -> list[str]:
    return list(FAMILIES)


__all__ = ["FAMILIES", "Family", "UnknownArchitecture", "family", "supported"]

"""Builds Kiln's optional C extension (kiln.native._kernels). Everything else is in pyproject.toml.

The extension needs a C compiler and the Python headers. It is optional: without them the
install still succeeds, and the engine runs on its numpy path (slower, same results)."""

from setuptools import Extension, setup

SOURCES = ["native/_kernels.c", "native/csrc/quant.c", "native/csrc/matmul.c", "native/csrc/dot_avx2.c", "native/csrc/dot_mxfp4_avx2.c", "native/csrc/dot_kquants_avx2.c", "native/csrc/dot_kquants_rows_avx2.c", "native/csrc/dot_kquants_avx512.c", "native/csrc/dot_q8_avx512.c", "native/csrc/attention.c", "native/csrc/encoder_attention.c", "native/csrc/attention_group.c", "native/csrc/attention_avx512.c", "native/csrc/kv_quant.c", "native/csrc/layer.c", "native/csrc/layer_rows.c", "native/csrc/moe_rows.c", "native/csrc/dequantize.c", "native/csrc/py_layer.c", "native/csrc/py_layer_args.c", "native/csrc/py_delta.c", "native/csrc/py_rows.c", "native/csrc/delta_net.c", "native/csrc/short_conv.c", "native/csrc/mla.c", "native/csrc/py_mla.c", "native/csrc/ffn_rows.c", "native/csrc/lora_rows.c", "native/csrc/quantize.c"]

setup(ext_modules=[Extension(
    "kiln.native._kernels", SOURCES, depends=["native/csrc/kiln.h", "native/csrc/layer.h", "native/csrc/py_layer.h", "native/csrc/kquants_avx2.h"],
    extra_compile_args=["-O3", "-fopenmp", "-std=c11", "-fno-math-errno", "-fvisibility=hidden", "-Wall",
                        "-Wno-unknown-pragmas"],
    extra_link_args=["-fopenmp"],
    optional=True,
), Extension(
    "kiln.native._reader", ["native/_reader.c", "native/reader_threads.c"], depends=["native/reader.h"],
    extra_compile_args=["-O2", "-std=gnu11", "-pthread", "-fvisibility=hidden", "-Wall"],
    extra_link_args=["-pthread"],
    optional=True,
)])

"""Weight-only quantized inference on the CPU with packed weights (GGUF block types, int8/int4).

`formats` knows the block layouts, `kernels` builds and drives the C++ kernels, `layers` has the
QuantLinear / QuantEmbedding modules. See BENCHMARKS.md ("quant") for the measurements.
"""

from __future__ import annotations

from pagedserve.config import QUANTIZATION_METHODS

METHODS = tuple(m for m in QUANTIZATION_METHODS if m is not None)  # config.py owns the list


def resolve_quantization(quantization: str | None, model_dir: str, device, load_format: str = "auto") -> str:
    """What to run: "none" (float weights), "gguf" (a GGUF's own block types, packed), or
    "int8" / "int4" (weight-only, quantized at load from float weights). "gguf_q8": as
    "gguf", and the few-row products (decode) quantize activations to int8 blocks first, as
    llama.cpp does (faster; not float-exact: a named option, never the default).

    None means: a GGUF file's own types on a CPU, float otherwise. "none" dequantizes a GGUF
    as before. The packed kernels are CPU kernels."""
    from pagedserve.executor.loader.gguf_loader import gguf_source

    q = "auto" if quantization is None else str(quantization).lower()
    if q not in METHODS + ("auto",):
        raise ValueError(f"quantization must be one of None, {', '.join(METHODS)}; got {quantization!r}.")
    is_gguf = gguf_source(model_dir) is not None
    on_cpu = getattr(device, "type", str(device)) == "cpu"
    if q == "auto":
        if not (is_gguf and on_cpu and load_format == "auto"):
            return "none"
        return "gguf" if _kernels_usable() else "none"
    if q in ("gguf", "gguf_q8") and not is_gguf:
        raise ValueError("quantization='gguf' needs a GGUF model file")
    if q != "none" and not on_cpu:
        raise NotImplementedError(f"quantization={q!r} runs on the CPU only (device={device}).")
    if q in ("gguf", "gguf_q8") and load_format != "auto":
        raise ValueError("quantization='gguf' loads the file's weights (load_format='auto')")
    return q


def _kernels_usable() -> bool:
    """Whether the packed kernels can run here (built, or buildable now); without them a GGUF
    falls back to its dequantized float model, as before. PAGEDSERVE_NO_CPP_KERNELS=1 opts out."""
    from pagedserve.executor.quant import kernels

    return kernels.try_load() is not None

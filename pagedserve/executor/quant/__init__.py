"""Weight-only quantized inference on the CPU with packed weights (GGUF block types, int8/int4).

`formats` knows the block layouts, `kernels` builds and drives the C++ kernels, `layers` has the
QuantLinear / QuantEmbedding modules. See BENCHMARKS.md ("quant") for the measurements.
"""

from __future__ import annotations

METHODS = ("none", "gguf", "int8", "int4")


def resolve_quantization(quantization: str | None, model_dir: str, device, load_format: str = "auto") -> str:
    """What to run: "none" (float weights), "gguf" (a GGUF's own block types, packed), or
    "int8" / "int4" (weight-only, quantized at load from float weights).

    None means: a GGUF file's own types on a CPU, float otherwise. "none" dequantizes a GGUF
    as before. The packed kernels are CPU kernels."""
    from pagedserve.executor.loader.gguf_loader import gguf_source

    q = "auto" if quantization is None else str(quantization).lower()
    if q not in METHODS + ("auto",):
        raise ValueError(f"quantization must be one of None, {', '.join(METHODS)}; got {quantization!r}.")
    is_gguf = gguf_source(model_dir) is not None
    on_cpu = getattr(device, "type", str(device)) == "cpu"
    if q == "auto":
        return "gguf" if is_gguf and on_cpu and load_format == "auto" else "none"
    if q == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' needs a GGUF model file")
    if q != "none" and not on_cpu:
        raise NotImplementedError(f"quantization={q!r} runs on the CPU only (device={device}).")
    if q == "gguf" and load_format != "auto":
        raise ValueError("quantization='gguf' loads the file's weights (load_format='auto')")
    return q

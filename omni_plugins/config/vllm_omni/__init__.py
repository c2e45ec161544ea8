"""vLLM-Omni's stage config files, read as omni-plugins pipelines (both of its layouts)."""

from omni_plugins.config.vllm_omni.layout import is_vllm_omni, read_vllm_omni

__all__ = ["is_vllm_omni", "read_vllm_omni"]

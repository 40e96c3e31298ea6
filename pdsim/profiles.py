"""Engine profiles for model mode (``--profile``): cited step-time and memory figures per model and GPU.

Every number comes from ``shared/research/overload-eval.md`` §3, which gives the sources:

* Step time: BLIS (inference-sim/inference-sim ``defaults.yaml``) fits vLLM 0.8.4 steps as
  ``β0 + β1 x uncached prefill tokens + β2 x running decode sequences`` (µs).
* KV bytes per token, computed for bf16 with grouped-query attention:
  layers x KV heads x head_dim x 2 (K and V) x 2 bytes.
* KV pool: GPU memory x 0.9 (the engines' default memory fraction) minus the bf16 weights.
* KV transfer: Mooncake Transfer Engine (kvcache-ai/Mooncake README) reaches 87-190 GB/s on RDMA;
  25 GB/s is a conservative single-NIC figure, and 1 ms a bootstrap handshake.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB = 1024
GB = 10**9
GIB = 1024**3
# vLLM's default KV block size (tokens): its pool is num_gpu_blocks x block_size.
VLLM_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    description: str
    step_base_s: float  # fixed cost of one engine step (one forward pass)
    per_prefill_token_s: float  # per uncached prompt token computed in the step
    per_decode_seq_s: float  # per running sequence that decodes a token in the step
    kv_bytes_per_token: int
    gpu_memory_bytes: int  # all GPUs of the server together
    weights_bytes: int
    memory_fraction: float = 0.9
    kv_bandwidth_gbps: float = 25.0
    bootstrap_s: float = 0.001
    gpus: int = 1
    context_length: int = 131072  # the model's own (Llama 3.1 / 3.3: 128k)

    @property
    def default_max_total_tokens(self) -> int:
        """The KV pool in tokens: what the engine has left after weights within its memory fraction."""
        return int(
            (self.gpu_memory_bytes * self.memory_fraction - self.weights_bytes) // self.kv_bytes_per_token
        )


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="llama3-8b-h100",
            description="Llama-3.1-8B on one H100 80 GB (TP1)",
            # BLIS vLLM 0.8.4 Llama-3.1-8B H100 TP1: β = (5752.7, 17.25, 6.00) µs.
            step_base_s=5752.7e-6,
            per_prefill_token_s=17.25e-6,
            per_decode_seq_s=6.00e-6,
            # 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB.
            kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
            gpu_memory_bytes=80 * GB,
            weights_bytes=16 * GB,  # 8B parameters in bf16
        ),
        Profile(
            name="llama3-70b-h100-tp4",
            description="Llama-3.3-70B on four H100 80 GB (TP4)",
            # BLIS vLLM 0.8.4 Llama-3.3-70B H100 TP4: β = (12601.3, 76.42, 66.84) µs.
            step_base_s=12601.3e-6,
            per_prefill_token_s=76.42e-6,
            per_decode_seq_s=66.84e-6,
            # 80 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 320 KiB (Mooncake: 40 GB ≈ 128k tokens).
            kv_bytes_per_token=80 * 8 * 128 * 2 * 2,
            gpu_memory_bytes=4 * 80 * GB,
            weights_bytes=140 * GB,  # 70B parameters in bf16
            gpus=4,
        ),
    )
}

assert PROFILES["llama3-8b-h100"].kv_bytes_per_token == 128 * KIB
assert PROFILES["llama3-70b-h100-tp4"].kv_bytes_per_token == 320 * KIB


def vllm_pool_tokens(tokens: int) -> int:
    """A pool as vLLM has it: whole blocks of ``VLLM_BLOCK_SIZE`` tokens."""
    return tokens // VLLM_BLOCK_SIZE * VLLM_BLOCK_SIZE


def engine_default_max_running(policy: str, profile: Profile, pool_tokens: int, context_length: int) -> int:
    """``max_running_requests`` as the engine computes it when the operator does not set it.

    * SGLang: ``min(max_total_num_tokens // 2, req_to_token_pool size)``, the request pool holding
      ``clamp(int(max_total_num_tokens / context_len * 512), 2048, 4096)`` requests
      (python/sglang/srt/model_executor/model_runner.py ``init_memory_pool`` and the scheduler's
      ``max_running_requests``).
    * vLLM: ``max_num_seqs`` = 1024 on GPUs of at least 70 GiB other than A100 (H100, H200, MI300x),
      256 otherwise (vllm/engine/arg_utils.py ``get_batch_defaults``).
    """
    if policy == "vllm":
        per_gpu = profile.gpu_memory_bytes / profile.gpus
        return 1024 if per_gpu >= 70 * GIB else 256
    req_pool = min(max(int(pool_tokens / context_length * 512), 2048), 4096)
    return max(1, min(pool_tokens // 2, req_pool))


def transfer_time_s(tokens: int, kv_bytes_per_token: int, bandwidth_gbps: float, bootstrap_s: float) -> float:
    """Engine time to move ``tokens`` tokens of KV between servers: bytes ÷ bandwidth plus the bootstrap."""
    return bootstrap_s + tokens * kv_bytes_per_token / (bandwidth_gbps * GB)

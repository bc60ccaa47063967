"""GPU profiles for the simulated engine: pool size, scheduler limits and step-time constants.

Step time follows the DistServe / Vidur form ``c0 + c1 * prefill_tokens + c2 * prefill_sq_sum +
c3 * decode_context_tokens + c4 * decode_batch``; every profile says in ``source`` where each constant
comes from. ``PROFILES`` holds at least ``"tiny"``, ``"fidelity"`` and ``"llama3-70b-fp8-8xh100"``.
See docs/simulator.md#step-time (and shared/VLLM_FACTS.md, "Step time").
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "PROFILES",
    "StepProfile",
    "get_profile",
    "kv_blocks_for_memory",
]


@dataclass(frozen=True)
class StepProfile:
    """Pool size, scheduler limits and step-time constants of one simulated GPU deployment."""

    name: str
    c0: float
    c1: float
    c2: float
    c3: float
    c4: float
    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    source: str = ""
    kv_transfer_s_per_block: float = 0.0
    """P/D: seconds a decode engine takes to pull one KV block from a prefill engine (0: instant)."""

    def step_time(
        self,
        prefill_tokens: int,
        prefill_sq_sum: float,
        decode_context_tokens: int,
        decode_batch: int,
    ) -> float:
        """Duration in seconds of one engine step with the given batch composition."""
        return (
            self.c0
            + self.c1 * prefill_tokens
            + self.c2 * prefill_sq_sum
            + self.c3 * decode_context_tokens
            + self.c4 * decode_batch
        )


def kv_blocks_for_memory(
    *,
    num_gpus: int,
    gpu_memory_bytes: float,
    gpu_memory_utilization: float,
    weights_bytes: float,
    overhead_bytes: float,
    kv_bytes_per_token: int,
    block_size: int = 16,
) -> int:
    """Number of KV blocks vLLM would allocate: (total * util - weights - overhead) / block bytes."""
    kv_bytes = num_gpus * gpu_memory_bytes * gpu_memory_utilization - weights_bytes - overhead_bytes
    return int(kv_bytes // (kv_bytes_per_token * block_size))


# --- Llama-3-70B FP8 on 8x H100 80GB (the seed case) -----------------------------------------
# KV bytes per token = layers x 2 (K and V) x kv_heads x head_dim x bytes
#                    = 80 x 2 x 8 x 128 x 1 (FP8 KV cache) = 163,840 B = 160 KiB/token,
# so one 16-token block is 2.5 MiB (split over the 8 tensor-parallel ranks, 1 KV head each).
_L70_KV_BYTES_PER_TOKEN = 80 * 2 * 8 * 128 * 1
# An "80GB" H100 SXM reports 85,520,809,984 bytes (79.65 GiB) total to torch.cuda.mem_get_info.
_H100_BYTES = 85_520_809_984
# Weights: 70.6e9 parameters in FP8 (1 byte) plus embedding and lm_head kept in BF16
# (2 x 128,256 x 8,192 x 2 B = 4.2 GB, minus their 1-byte share already counted) ~= 72.7 GB.
_L70_WEIGHTS = 70.6e9 + 2 * 128_256 * 8_192 * 1
# Non-KV runtime memory vLLM subtracts after profiling (peak activations for an 8192-token
# batch, CUDA graphs, NCCL buffers): ~2 GB per GPU.
_L70_OVERHEAD = 8 * 2.0e9
_L70_BLOCKS = kv_blocks_for_memory(
    num_gpus=8,
    gpu_memory_bytes=_H100_BYTES,
    gpu_memory_utilization=0.92,  # vLLM's current default
    weights_bytes=_L70_WEIGHTS,
    overhead_bytes=_L70_OVERHEAD,
    kv_bytes_per_token=_L70_KV_BYTES_PER_TOKEN,
)

# Step-time constants (first-principles estimates, the usual roofline reasoning of Vidur):
# c0  fixed per-step cost: reading the FP8 weights once per step (70.6e9 B / 8 GPUs / 3.35 TB/s
#     = 2.6 ms) plus all-reduces (2 per layer x 80 layers), kernel launches and the scheduler
#     loop; published vLLM TP8 70B FP8 inter-token latency at batch 1 is ~8-10 ms -> 8 ms.
# c1  prefill GEMM cost per token: 2 x 70.6e9 FLOP = 141 GFLOP/token over 8 x 1,979 TFLOPS
#     dense FP8 (H100 SXM, no sparsity) at ~25% MFU (TP8 all-reduces and non-GEMM work keep
#     it low; ~4.0 PFLOP/s) -> 3.6e-5 s/token (an 8192-token chunk takes ~0.29 s).
# c2  attention: 4 x layers x q_heads x head_dim = 4 x 80 x 64 x 128 = 2.6 MFLOP per causal
#     query-key pair at ~30% of the BF16 peak (8 x 989e12 x 0.3) -> 1.1e-9 s per pair; the
#     sq_sum input counts the causal triangle in full (2x the pairs), so c2 = 5.5e-10.
# c3  decode KV read per context token: 160 KiB/token across the pool (20 KiB per GPU) at
#     ~70% of 3.35 TB/s HBM bandwidth -> 20,480 / 2.35e12 = 8.7e-9 s per context token.
# c4  per decoding sequence (sampling, logits of a 128K vocabulary, bookkeeping): ~20 us.
_L70_SOURCE = (
    "pool: KV/token = 80 layers x 2 x 8 kv heads x 128 head_dim x 1 B (FP8) = 160 KiB, block = 2.5 MiB; "
    "8 x H100 80GB (85,520,809,984 B each) x 0.92 util - weights 70.6e9 FP8 + BF16 embed/lm_head "
    f"(~72.7 GB) - ~2 GB/GPU activations+graphs = {_L70_BLOCKS} blocks; "
    "c0=8 ms (weights read 2.6 ms + 160 all-reduces + launch; vLLM TP8 70B FP8 ITL ~8-10 ms); "
    "c1=3.6e-5 s/token (141 GFLOP/token at 25% of 8x1979 TFLOPS dense FP8); "
    "c2=5.5e-10 per unit of chunk*(context+chunk) (2.6 MFLOP per causal q-k pair at 30% of "
    "8x989 TFLOPS BF16, the triangle counted twice); "
    "c3=8.7e-9 s per decode context token (20 KiB/GPU at 70% of 3.35 TB/s); "
    "c4=2e-5 s per decoding sequence; max_num_batched_tokens 8192 and max_num_seqs 1024 "
    "(vLLM's defaults on H100-class GPUs), max_model_len 8192."
)

PROFILES: dict[str, StepProfile] = {
    "tiny": StepProfile(
        name="tiny",
        c0=0.004,
        c1=2.0e-6,
        c2=0.0,
        c3=1.0e-7,
        c4=5.0e-5,
        num_gpu_blocks=512,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        source=(
            "test profile, not a real GPU: 511 usable blocks (8,176 tokens) so a handful of "
            "requests fills the pool; max_num_batched_tokens 2048 and max_num_seqs 256 (vLLM's "
            "defaults on small GPUs); "
            "c0=4 ms, c1=2 us/prefill token, c3=0.1 us/decode context token, c4=50 us/sequence "
            "chosen so a 1k-token prompt prefills in ~6 ms and decode steps take ~5 ms."
        ),
    ),
    "fidelity": StepProfile(
        name="fidelity",
        c0=0.02,
        c1=0.0,
        c2=0.0,
        c3=0.0,
        c4=0.0,
        num_gpu_blocks=14000,
        block_size=16,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=9216,
        source=(
            "matches shared/fidelity/vllm_*.json: vLLM 0.33's real Scheduler driven with a fixed "
            "0.02 s per step (sim_time_s = steps x 0.02), block 16, max_num_seqs 256, "
            "max_num_batched_tokens 8192, max_model_len 9216, 14000 blocks (vllm_a_burst_14000)."
        ),
    ),
    "llama3-70b-fp8-8xh100": StepProfile(
        name="llama3-70b-fp8-8xh100",
        c0=0.008,
        c1=3.6e-5,
        c2=5.5e-10,
        c3=8.7e-9,
        c4=2.0e-5,
        num_gpu_blocks=_L70_BLOCKS,
        block_size=16,
        max_num_seqs=1024,
        max_num_batched_tokens=8192,
        max_model_len=8192,
        source=_L70_SOURCE,
        # P/D: a 2.5 MiB block over NIXL RDMA on 8 x 400 Gb/s NICs (50 GB/s each, ~70% achieved:
        # ~280 GB/s per node pair) -> 9.4 us per block; a 7k-token prompt (440 blocks) in ~4 ms
        kv_transfer_s_per_block=2.5 * 2**20 / 280e9,
    ),
}


def get_profile(name: str) -> StepProfile:
    """Return the profile called ``name``; raise ``ValueError`` listing the known names otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown simulator profile {name!r}; choose one of: {known}") from None

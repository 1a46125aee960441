"""The rank-0 loader's CUDA path at world size 1: CUDA parameters, NCCL transport, pinned buffers.

Two measurements, printed as one JSON object on stdout:

1. ``correctness``: a tiny random Llama checkpoint (``transformers``) loaded into a
   Megatron-core GPTModel on the GPU; max abs difference of the logits (fp32).
2. ``throughput``: a random bf16 Llama-shaped safetensors checkpoint of the given
   size (written here, sharded with an index) loaded into a bf16 GPTModel on the
   GPU: seconds, GB/s, peak host RSS growth, GPU memory, and a bit-exact check of
   sampled parameters against the file.

Run on a machine with one NVIDIA GPU, torch, transformers, safetensors and
megatron-core (``pip install --no-deps megatron-core==0.16.1``) and megastart
(``pip install --no-deps -e .``)::

    python bench/gpu/loader_ws1.py                 # ~4.4 GB checkpoint
    python bench/gpu/loader_ws1.py --layers 2      # quicker
    python bench/gpu/loader_ws1.py --device cpu    # the same script on CPU (gloo)

The page cache is not dropped: the throughput run reads files this script has
just written, so it measures the loader, not the disk.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument(
        "--workdir", default=None, help="where to write the checkpoints (default: a temp dir)"
    )
    args = parser.parse_args()

    import torch

    from megastart.loader.settings import Rank0LoaderSettings

    device = torch.device(args.device)
    _init_world(device)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        settings = Rank0LoaderSettings(bucket_mb=args.bucket_mb, progress=False)
        result = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "correctness": _correctness(Path(workdir) / "tiny", device, settings),
            "throughput": _throughput(Path(workdir) / "big", device, settings, args),
        }
    print(json.dumps(result, indent=2))


def _init_world(device):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as megatron_random

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cpu":
        from megastart.demo.cpu import initialize_megatron

        initialize_megatron()
        return
    parallel_state.initialize_model_parallel()
    torch.manual_seed(1234)
    megatron_random.model_parallel_cuda_manual_seed(1234)


def _build(hf_config, device, dtype):
    from megastart.demo.model import build_gpt_chunks

    return [chunk.to(device) for chunk in build_gpt_chunks(hf_config, dtype=dtype)]


def _correctness(directory: Path, device, settings) -> dict:
    import torch
    import transformers

    from megastart import load_hf_checkpoint

    config = transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=1000,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.save_pretrained(directory, max_shard_size="200KB")
    chunks = _build(transformers.AutoConfig.from_pretrained(directory), device, torch.float32)
    report = load_hf_checkpoint(chunks, str(directory), settings=settings)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        expected = hf.to(device)(ids.to(device)).logits.float()
        seq = ids.shape[1]
        got = chunks[0](
            input_ids=ids.to(device),
            position_ids=torch.arange(seq, device=device).unsqueeze(0).expand_as(ids),
            attention_mask=torch.ones(1, 1, seq, seq, dtype=torch.bool, device=device).triu(1),
        )[..., : config.vocab_size].float()
    return {
        "parameter_device": str(next(chunks[0].parameters()).device),
        "transport": "nccl" if device.type == "cuda" else "gloo",
        "max_abs_logit_diff": (got - expected).abs().max().item(),
        "report": report.summary(),
    }


def _throughput(directory: Path, device, settings, args) -> dict:
    import torch
    import transformers
    from safetensors.torch import load_file

    from megastart import load_hf_checkpoint

    config = transformers.LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    nbytes = _write_random_checkpoint(directory, config)
    chunks = _build(config, device, torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        gpu_before = torch.cuda.memory_allocated()
    rss_before = _reset_peak_rss()
    start = time.perf_counter()
    report = load_hf_checkpoint(chunks, str(directory), settings=settings)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    shard = load_file(directory / "model-00001-of-00002.safetensors")
    params = dict(chunks[0].named_parameters())
    exact = torch.equal(
        params["embedding.word_embeddings.weight"][: args.vocab].cpu(),
        shard["model.embed_tokens.weight"],
    )
    exact &= torch.equal(
        params["decoder.layers.0.input_layernorm.weight"].cpu(),
        shard["model.layers.0.input_layernorm.weight"],
    )
    out = {
        "checkpoint_gb": nbytes / 1e9,
        "parameters": sum(p.numel() for p in params.values()),
        "bucket_mb": args.bucket_mb,
        "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9,
        "report": report.summary(),
        "host_peak_rss_growth_gb": None if rss_before is None else (_peak_rss() - rss_before) / 1e9,
        "sampled_parameters_bit_exact": bool(exact),
    }
    if device.type == "cuda":
        out["gpu_peak_extra_gb"] = (torch.cuda.max_memory_allocated() - gpu_before) / 1e9
    return out


def _write_random_checkpoint(directory: Path, config) -> int:
    """A bf16 Llama checkpoint with random tensors, in two shards plus an index."""
    import torch
    from safetensors.torch import save_file

    h, f, d = (
        config.hidden_size,
        config.intermediate_size,
        config.hidden_size // config.num_attention_heads,
    )
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (config.vocab_size, h),
    }
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (config.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (config.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, config.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (f, h),
            p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        }
    directory.mkdir(parents=True)
    config.save_pretrained(directory)
    names = list(shapes)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map, total = {}, 0
    generator = torch.Generator().manual_seed(0)
    for index, part in enumerate(halves):
        file = f"model-{index + 1:05d}-of-00002.safetensors"
        tensors = {n: torch.randn(shapes[n], generator=generator).to(torch.bfloat16) for n in part}
        save_file(tensors, directory / file)
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map |= dict.fromkeys(part, file)
        del tensors
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return total


def _reset_peak_rss() -> int | None:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS and return it; None if not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return None
    return _status_bytes("VmRSS")


def _peak_rss() -> int:
    return _status_bytes("VmHWM")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


if __name__ == "__main__":
    sys.exit(main())

"""The rank-0 loader's CUDA path at world size 1: CUDA parameters, NCCL transport, pinned buffers.

Two measurements, printed as one JSON object on stdout:

1. ``correctness``: a tiny random Llama checkpoint (``transformers``) loaded into a
   Megatron-core GPTModel on the GPU; max abs difference of the logits (fp32).
2. ``throughput``: a random bf16 Llama-shaped safetensors checkpoint of the given
   shape (written by ``megastart.demo.checkpoints``, sharded with an index) loaded
   into a bf16 GPTModel on the GPU, once per bucket size and page-cache state
   (``cold``: dropped from the page cache first; ``warm``: cached): seconds,
   GB/s, peak host RSS growth, GPU memory, and a bit-exact check of sampled
   parameters against the file.

Run on a machine with one NVIDIA GPU, torch, transformers, safetensors and
megatron-core (``pip install --no-deps megatron-core==0.16.1``) and megastart
(``pip install --no-deps -e .``)::

    python bench/gpu/loader_ws1.py                 # ~4 GB checkpoint, 32 and 256 MiB buckets
    python bench/gpu/loader_ws1.py --layers 2      # quicker
    python bench/gpu/loader_ws1.py --device cpu    # the same script on CPU (gloo)
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
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[32, 256])
    parser.add_argument(
        "--workdir", default=None, help="where to write the checkpoints (default: a temp dir)"
    )
    args = parser.parse_args()

    import torch

    from megastart.loader.settings import Rank0LoaderSettings

    device = torch.device(args.device)
    _init_world(device)
    with tempfile.TemporaryDirectory(dir=args.workdir) as workdir:
        settings = Rank0LoaderSettings(bucket_mb=args.bucket_mb[0], progress=False)
        result = {
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "correctness": _correctness(Path(workdir) / "tiny", device, settings),
            "throughput": _throughput(Path(workdir) / "big", device, args),
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


def _throughput(directory: Path, device, args) -> list[dict]:
    import torch
    import transformers
    from safetensors import safe_open

    from megastart import load_hf_checkpoint
    from megastart.bench.limits import drop_from_page_cache
    from megastart.bench.memory import peak_rss_bytes, reset_peak_rss, rss_bytes
    from megastart.demo.checkpoints import make_checkpoint
    from megastart.loader.settings import Rank0LoaderSettings

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
        dtype="bfloat16",
    )
    make_checkpoint(config, directory)
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(str(directory / f) for f in set(weight_map.values()))
    nbytes = sum(os.path.getsize(f) for f in files)
    chunks = _build(config, device, torch.bfloat16)
    params = dict(chunks[0].named_parameters())
    sampled = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.layers.0.input_layernorm.weight": "model.layers.0.input_layernorm.weight",
    }
    runs = []
    for bucket_mb in args.bucket_mb:
        for cache in ("cold", "warm"):
            for param in params.values():
                param.data.zero_()
            if cache == "cold":
                drop_from_page_cache(files)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                gpu_before = torch.cuda.memory_allocated()
            try:
                reset_peak_rss(os.getpid())
                rss_before: int | None = rss_bytes(os.getpid())
            except OSError:  # clear_refs is not writable in some sandboxes
                rss_before = None
            start = time.perf_counter()
            settings = Rank0LoaderSettings(bucket_mb=bucket_mb, progress=False)
            report = load_hf_checkpoint(chunks, str(directory), settings=settings)
            if device.type == "cuda":
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            host_peak_growth = (
                None if rss_before is None else peak_rss_bytes(os.getpid()) - rss_before
            )
            exact = True  # checked after the peak was read: the check itself reads tensors
            for megatron, hf in sampled.items():
                with safe_open(directory / weight_map[hf], "pt") as f:
                    expected = f.get_tensor(hf)
                exact &= torch.equal(params[megatron][: expected.shape[0]].cpu(), expected)
            run = {
                "bucket_mb": bucket_mb,
                "page_cache": cache,
                "checkpoint_gb": nbytes / 1e9,
                "parameters": sum(p.numel() for p in params.values()),
                "seconds": seconds,
                "gb_per_s": nbytes / seconds / 1e9,
                "report": report.summary(),
                "host_peak_rss_growth_gb": None
                if host_peak_growth is None
                else host_peak_growth / 1e9,
                "sampled_parameters_bit_exact": bool(exact),
            }
            if device.type == "cuda":
                run["gpu_peak_extra_gb"] = (torch.cuda.max_memory_allocated() - gpu_before) / 1e9
            runs.append(run)
    return runs


if __name__ == "__main__":
    sys.exit(main())

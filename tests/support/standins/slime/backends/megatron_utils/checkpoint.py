"""Stand-in of slime's ``slime/backends/megatron_utils/checkpoint.py`` at 624b824a: the HF branch
of ``load_checkpoint`` (a ``--load`` that is not a Megatron checkpoint). ``ARGS`` stands in for
Megatron-LM's ``get_args()``."""

from types import SimpleNamespace

ARGS = SimpleNamespace(load=None, fp16=False, bf16=False, load_main_params_from_ckpt=False)


def get_args():
    return ARGS


def load_checkpoint(
    ddp_model, optimizer, opt_param_scheduler, checkpointing_context, skip_load_to_model_and_opt
):
    args = get_args()
    load_path = args.load
    return _load_checkpoint_hf(
        ddp_model=ddp_model, optimizer=optimizer, args=args, load_path=load_path
    )


def _load_checkpoint_hf(ddp_model, optimizer, args, load_path: str):
    from slime.backends.megatron_utils.hf_to_megatron import load_hf_weights

    load_hf_weights(args, ddp_model, load_path)
    if (args.fp16 or args.bf16) and optimizer is not None:
        optimizer.reload_model_params()
    iteration = 0
    num_floating_point_operations_so_far = 0
    return iteration, num_floating_point_operations_so_far

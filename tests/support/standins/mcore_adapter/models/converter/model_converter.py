"""Stand-in of ROLL's ``mcore_adapter/models/converter/model_converter.py`` at 8eb27cc2:
``ModelConverter(mca_config, ..., resized_vocab_size=None)`` and
``load_mca_state_dict_from_hf(model_path, vp_stage)``, which returns one virtual stage's state
dict. ROLL's conversion is replaced by a record that it ran and a freshly built chunk's state."""

CONVERTED: list[int] = []


class ModelConverter:
    def __init__(
        self,
        mca_config,
        verbose=False,
        tensor_model_parallel_rank=None,
        pipeline_model_parallel_rank=None,
        expert_model_parallel_rank=None,
        expert_tensor_parallel_rank=None,
        to_hf=False,
        efficient_mode=False,
        resized_vocab_size=None,
    ):
        self.mca_config = mca_config
        self.resized_vocab_size = resized_vocab_size

    def load_mca_state_dict_from_hf(self, model_path: str, vp_stage: int):
        from megastart.harness.model import build_gpt_chunks

        CONVERTED.append(vp_stage)
        return build_gpt_chunks(self.mca_config.hf_config)[vp_stage].state_dict()

"""Stand-in of ROLL's ``mcore_adapter/models/model_factory.py`` at 8eb27cc2: ``VirtualModels``
(building and ``load_state_dict`` as there, without PEFT) and the HF branch of
``PretrainedModel.from_pretrained``, in ROLL's order (build the chunks, convert each virtual
stage, ``load_state_dict(strict=False)``, assert no key missing or unexpected). The model class
builds megastart's harness ``GPTModel`` chunks."""

from megatron.core import mpu

from .converter.model_converter import ModelConverter


class McaModelConfig:
    def __init__(self, hf_config):
        self.hf_config = hf_config
        self.virtual_pipeline_model_parallel_size = (
            mpu.get_virtual_pipeline_model_parallel_world_size()
        )
        self.tie_embeddings_and_output_weights = bool(
            getattr(hf_config, "tie_word_embeddings", False)
        )

    @classmethod
    def from_pretrained(cls, model_name_or_path, args=None):
        from transformers import AutoConfig

        return cls(AutoConfig.from_pretrained(model_name_or_path))


class VirtualModels:
    def __init__(self, cls, config, *args, **kwargs):
        self.models = []
        self.config = config
        for i in range(config.virtual_pipeline_model_parallel_size or 1):
            if (config.virtual_pipeline_model_parallel_size or 1) > 1:
                mpu.set_virtual_pipeline_model_parallel_rank(i)
                kwargs["vp_stage"] = i
            self.models.append(cls(config, *args, **kwargs))

    def load_state_dict(self, state_dict, strict=True):
        if len(self.models) == 1:
            if "model" in state_dict:
                state_dict = state_dict["model"]
            return self.models[0].load_state_dict(state_dict, strict=strict)
        all_missing_keys, all_unexpected_keys = [], []
        for i, model in enumerate(self.models):
            ret = model.load_state_dict(state_dict[f"model{i}"], strict=strict)
            if not strict:
                all_missing_keys.extend(ret[0])
                all_unexpected_keys.extend(ret[1])
        return all_missing_keys, all_unexpected_keys


class PretrainedModel:
    config_class = McaModelConfig

    @classmethod
    def from_pretrained(
        cls, model_name_or_path, args=None, use_cpu_initialization=False, tokenizer=None
    ):
        config = cls.config_class.from_pretrained(model_name_or_path, args)
        models = VirtualModels(cls, config=config)
        state_dict = {}
        converter = ModelConverter(config, resized_vocab_size=None)
        for i in range(len(models.models)):
            key = "model"
            if len(models.models) > 1:
                mpu.set_virtual_pipeline_model_parallel_rank(i)
                key = f"{key}{i}"
            state_dict[key] = converter.load_mca_state_dict_from_hf(model_name_or_path, vp_stage=i)
        missing_keys, unexpected_keys = models.load_state_dict(state_dict, strict=False)
        if missing_keys:
            missing_keys = [key for key in missing_keys if not key.endswith("._extra_state")]
        if unexpected_keys and config.tie_embeddings_and_output_weights:
            unexpected_keys = [
                key for key in unexpected_keys if not key.endswith("output_layer.weight")
            ]
        assert unexpected_keys is None or len(unexpected_keys) == 0, (
            f"unexpected_keys: {unexpected_keys}"
        )
        assert missing_keys is None or len(missing_keys) == 0, f"missing_keys: {missing_keys}"
        return models


class McaGPTModel(PretrainedModel):
    """Builds this rank's chunk for ``vp_stage`` (megastart's harness ``GPTModel``)."""

    def __new__(cls, config, vp_stage=None):
        from megastart.harness.model import build_gpt_chunks

        return build_gpt_chunks(config.hf_config)[vp_stage or 0]

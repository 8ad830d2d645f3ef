"""FAT5 — Flash Attention T5.

``import fat5`` registers the FAT5 config and models with transformers' Auto classes, so
``AutoModelForSeq2SeqLM.from_pretrained(fat5_dir)`` works on a saved FAT5 model, and registers
``attn_implementation="fat5"``, which runs transformers' own T5, mT5 and UMT5 on FAT5's attention kernels
(``fat5.integrations.transformers_t5``; ``apply_fat5_kernels_to_t5`` adds its RMSNorm and fused loss).
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSeq2SeqLM,
    AutoModelForSequenceClassification,
    AutoModelForTextEncoding,
    AutoModelForTokenClassification,
)

from .configuration_fat5 import FAT5Config
from .errors import FAT5Error
from .integrations.transformers_t5 import apply_fat5_kernels_to_t5
from .integrations.transformers_t5 import register as _register_attention_with_transformers
from .modeling_fat5 import (
    FAT5EncoderModel,
    FAT5ForConditionalGeneration,
    FAT5ForQuestionAnswering,
    FAT5ForSequenceClassification,
    FAT5ForTokenClassification,
    FAT5Model,
    FAT5PreTrainedModel,
)

__version__ = "0.1.0"

AutoConfig.register(FAT5Config.model_type, FAT5Config, exist_ok=True)
for auto_class, model_class in (
    (AutoModel, FAT5Model),
    (AutoModelForSeq2SeqLM, FAT5ForConditionalGeneration),
    # transformers 5.24's pipeline for T5 is "text-generation" (it dropped "text2text-generation"): it tries
    # AutoModelForCausalLM, then the classes that config.architectures names in transformers, T5's among them
    (AutoModelForCausalLM, FAT5ForConditionalGeneration),
    (AutoModelForTextEncoding, FAT5EncoderModel),
    (AutoModelForSequenceClassification, FAT5ForSequenceClassification),
    (AutoModelForTokenClassification, FAT5ForTokenClassification),
    (AutoModelForQuestionAnswering, FAT5ForQuestionAnswering),
):
    auto_class.register(FAT5Config, model_class, exist_ok=True)
_register_attention_with_transformers()

__all__ = [
    "FAT5Config",
    "FAT5EncoderModel",
    "FAT5Error",
    "FAT5ForConditionalGeneration",
    "FAT5ForQuestionAnswering",
    "FAT5ForSequenceClassification",
    "FAT5ForTokenClassification",
    "FAT5Model",
    "FAT5PreTrainedModel",
    "apply_fat5_kernels_to_t5",
]

"""PEFT on FAT5 as on T5: the task-type defaults (LoRA, IA3 without target_modules) and prefix tuning's generate."""

import copy

import pytest
import torch
from helpers import fat5_from_hf, make_hf, padded_batch
from peft import IA3Config, LoraConfig, PrefixTuningConfig, get_peft_model


@pytest.mark.parametrize("peft_config", [LoraConfig(task_type="SEQ_2_SEQ_LM"), IA3Config(task_type="SEQ_2_SEQ_LM")],
                         ids=["lora", "ia3"])
def test_default_target_modules_are_t5s(peft_config):
    hf = make_hf("t5v1.1")
    model = fat5_from_hf(hf, "t5v1.1")
    expected = get_peft_model(copy.deepcopy(hf), copy.deepcopy(peft_config))
    actual = get_peft_model(model, copy.deepcopy(peft_config))
    assert actual.targeted_module_names and sorted(actual.targeted_module_names) == sorted(
        expected.targeted_module_names
    )
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(actual(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss,
                                   expected(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss)


def test_prefix_tuning_generates_from_its_prefix():
    """generate continues the prefix that training reads: its greedy ids are those of T5's full forwards with the
    prefix, token by token (T5's own generate ignores the prefix: transformers hands it an empty cache beside it)."""
    hf = make_hf("t5v1.1")
    model = fat5_from_hf(hf, "t5v1.1")
    tuned = []
    for base in (hf, model):
        torch.manual_seed(0)
        peft_model = get_peft_model(base, PrefixTuningConfig(task_type="SEQ_2_SEQ_LM", num_virtual_tokens=4))
        with torch.no_grad():
            for parameter in peft_model.prompt_encoder.parameters():
                parameter.mul_(50)  # a prefix strong enough to change what is generated
        tuned.append(peft_model.eval())
    t5, fat5 = tuned
    input_ids, attention_mask, labels = padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(fat5(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss,
                                   t5(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss)
        expected = torch.zeros(len(input_ids), 1, dtype=torch.long)
        for _ in range(5):
            logits = t5(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=expected,
                        use_cache=False).logits
            expected = torch.cat([expected, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        generated = fat5.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5,
                                  min_new_tokens=5, do_sample=False)
        without_prefix = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=5,
                                        min_new_tokens=5, do_sample=False)
    assert torch.equal(generated, expected)
    assert not torch.equal(generated, without_prefix)

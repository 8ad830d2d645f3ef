"""The seq2seq generation pipeline a saved FAT5 folder names in its config's ``custom_pipelines``.

transformers 5.24 removed its ``text2text-generation`` pipeline, and its ``text-generation`` one cuts as many tokens
off the output as the prompt had (right for a decoder-only model, which repeats its prompt; not for an
encoder-decoder). ``pipeline("text2text-generation", model=folder, trust_remote_code=True)`` (or
``"text-generation"``) builds this one: text in, ``[{"generated_text": ...}]`` out, one entry per returned
sequence, with ``generate``'s options (``max_new_tokens``, ``num_beams``, ``num_return_sequences``...) passed to
``generate`` as they are. Remote code: it imports only transformers.
"""

from transformers import Pipeline


class Text2TextGenerationPipeline(Pipeline):
    """Tokenise the text, ``model.generate`` from it, decode what the decoder generated."""

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, truncation=None, skip_special_tokens=None, clean_up_tokenization_spaces=None,
                             **generate_kwargs):
        preprocess = {} if truncation is None else {"truncation": truncation}
        postprocess = {name: value for name, value in (("skip_special_tokens", skip_special_tokens),
                                                       ("clean_up_tokenization_spaces", clean_up_tokenization_spaces))
                       if value is not None}
        return preprocess, generate_kwargs, postprocess

    def preprocess(self, text, truncation=False):
        if not isinstance(text, str):
            raise TypeError(f"{type(self).__name__} takes a string or a list of strings, not {type(text).__name__}")
        return self.tokenizer(text, return_tensors="pt", truncation=truncation)

    def _forward(self, model_inputs, **generate_kwargs):
        batch_size = model_inputs["input_ids"].shape[0]
        output_ids = self.model.generate(**model_inputs, **generate_kwargs)
        # (inputs, sequences per input, length): the batched pipeline hands postprocess one input's sequences
        return {"output_ids": output_ids.reshape(batch_size, -1, output_ids.shape[-1])}

    def postprocess(self, model_outputs, skip_special_tokens=True, clean_up_tokenization_spaces=None):
        return [
            {"generated_text": self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                                     clean_up_tokenization_spaces=clean_up_tokenization_spaces)}
            for ids in model_outputs["output_ids"][0]
        ]

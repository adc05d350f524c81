"""A tokenizer and a 2-layer Qwen2 model made offline, in a second, for real TRL runs in tests and benchmarks.

The tokenizer is byte-level (every text encodes) with Qwen3's chat template as TRL ships it, so TRL
recognises the template and parses `<tool_call>` blocks. The model is a random 2-layer Qwen2 whose
attention and MLP outputs are zeroed and whose embeddings and head are set so that it is a bigram
machine: after the assistant header it always writes one tool call, `echo(message=TOOL_MESSAGE)`, then
ends its turn. Generation is therefore deterministic while the trainer, the sampler and the backward
pass run for real.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_MESSAGE = "hello"
# One added token for the whole call, newlines included, so the bigram chain has no repeated token.
TOOL_CALL = "\n" + json.dumps({"name": "echo", "arguments": {"message": TOOL_MESSAGE}}) + "\n"
# Far above anything the random remainder of the model adds: the chain is followed at temperature 1.
CHAIN_LOGIT = 100.0


def build_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import qwen3_chat_template

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    core = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>",
                          "</think>", TOOL_CALL])
    tokenizer.chat_template = qwen3_chat_template  # TRL matches it by text and adds its response schema
    return tokenizer


def build_model(tokenizer: Any) -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    token = tokenizer.convert_tokens_to_ids
    (newline,) = tokenizer.encode("\n", add_special_tokens=False)  # the assistant header ends with it
    chain = [(newline, token("<tool_call>")), (token("<tool_call>"), token(TOOL_CALL)),
             (token(TOOL_CALL), token("</tool_call>")), (token("</tool_call>"), tokenizer.eos_token_id)]
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream carries the current token's embedding only
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
        embedding.zero_()
        head.zero_()
        embedding[:, 0] = 1.0  # any other token: direction 0, which ends the turn
        head[tokenizer.eos_token_id, 0] = CHAIN_LOGIT
        for direction, (current, following) in enumerate(chain, start=1):
            embedding[current] = 0.0
            embedding[current, direction] = 1.0
            head[following, direction] = CHAIN_LOGIT
    return model

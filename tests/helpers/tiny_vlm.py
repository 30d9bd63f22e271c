"""A tiny random vision-language model made on the fly with transformers: Idefics3 (SigLIP-style
vision encoder, pixel-shuffle connector, Llama text model: the SmolVLM architecture), saved
with a tokenizer, chat template and image processor made here too (no download).

Idefics3 because vLLM's CPU build runs it without torchvision (docs/multimodal.md lists the
architectures that need torchvision there). Sizes: text hidden 128 with 4 heads (head size
32, one vLLM's CPU attention takes), vision 56x56 tiles of 14-pixel patches; an image is
resized to at most 112 pixels a side and split into up to 2x2 tiles plus the whole image,
4 tokens each (``image_seq_len``) with their row/column tags.
"""
from __future__ import annotations

import os

SPECIAL = ["<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>", "<global-img>"] + \
    [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
CHAT = ("<|im_start|>{% for m in messages %}{{ m['role'] | capitalize }}:{% if m['content'] is string %}"
        "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>"
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
        "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
VOCAB = 256


def make_tiny_vlm(path: str, seed: int = 0):
    """Create and save the tiny Idefics3 at ``path``; returns the transformers model (fp32, eval)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    vocab = {"<unk>": 0}
    for s in SPECIAL:
        vocab[s] = len(vocab)
    for c in [*map(chr, range(33, 127)), "\u0120", "\u010a"]:  # printable ASCII; space and newline as byte-level
        vocab[c] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"w{len(vocab)}"] = len(vocab)
    # one token per byte-level character (GPT-2's byte alphabet, as llguidance reads it)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                                                pre_tokenizers.Split("", behavior="isolated")])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(s, special=True) for s in SPECIAL])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>",
                                               eos_token="<end_of_utterance>", unk_token="<unk>", pad_token="<unk>")
    tok.chat_template = CHAT
    eos = vocab["<end_of_utterance>"]
    text = dict(model_type="llama", vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=eos, pad_token_id=0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=56,
                  patch_size=14)
    cfg = transformers.Idefics3Config(vision_config=vision, text_config=text, image_token_id=vocab["<image>"],
                                      scale_factor=2, tie_word_embeddings=False, pad_token_id=0, eos_token_id=eos)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():  # large random weights: outputs depend visibly on the image and the text
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    images = Idefics3ImageProcessorPil(size={"longest_edge": 112}, max_image_size={"longest_edge": 56},
                                       do_image_splitting=True)
    transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                   chat_template=CHAT).save_pretrained(path)
    return model

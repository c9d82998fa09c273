"""A zoo of real HuggingFace ``transformers`` architectures in tiny random configurations.

Every entry is an :class:`Arch`: the model class users train, a tiny config (one layer, which
holds every op of the architecture; two where the layers differ or interact: alternating
sliding and global attention, one layer's weights run twice, a checkpoint per layer, a
relative-position bias the first layer computes and the others reuse, encoder-decoders,
stages, and the known gaps, measured on two; hidden size 32-64, 2-4 heads, vocabulary 128,
sequences of 12 tokens, 32x32 images), seeded example inputs, and how to read one output
tensor and a training loss off the model's output. One layer rather than two takes about a
third off every capture, which is most of the zoo's time on a small CPU. Nothing
is downloaded: models are built from config objects with ``torch.manual_seed(0)``, so two
builds are equal. Every dropout (and layer drop, drop path, SpecAugment masking) is 0, so
train mode is deterministic and two copies of a model train identically.

The zoo is shared by ``test_hf_zoo.py`` and ``tools/support_matrix.py``; an :class:`Arch` is
a ``_zoo_entry.ZooEntry``, so the checks of ``_hf_checks.py`` run on it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
import transformers
from _zoo_entry import Example, cross_entropy_on, field, mean_square_of, model_loss, tensor_leaves

__all__ = ["Arch", "Example", "FAMILIES", "ZOO", "arch", "tensor_leaves"]

FAMILIES = ("decoder", "moe", "ssm", "encoder", "encoder-decoder", "audio", "vision")

VOCAB = 128
BATCH = 2
SEQ = 12
IMAGE = 32


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture of the zoo.

    Attributes:
        name: the id used in test ids, ``KNOWN_GAPS`` and the support matrix.
        family: one of :data:`FAMILIES`.
        model_class: the ``transformers`` class that is instantiated.
        config: builds the tiny config (a fresh object per call).
        inputs: builds the example call from a seeded generator.
        output: reads the tensor to compare (logits, last hidden state, ...) off the output.
        loss: a scalar fp32 training loss computed from the output.
        gradient_checkpointing: build the model with gradient checkpointing enabled.
    """

    name: str
    family: str
    model_class: type[nn.Module]
    config: Callable[[], transformers.PretrainedConfig]
    inputs: Callable[[torch.Generator], Example]
    output: Callable[[Any], torch.Tensor]
    loss: Callable[[Any], torch.Tensor]
    gradient_checkpointing: bool = False

    def build(self) -> nn.Module:
        """A fresh model in eval mode; equal parameters on every call."""
        torch.manual_seed(0)
        model = self.model_class(self.config())
        if self.gradient_checkpointing:
            # non-reentrant by default; transformers before 5.18 names it gradient_...
            enable = getattr(model, "activation_checkpointing_enable", None) or \
                model.gradient_checkpointing_enable
            enable()
        return model.eval()

    def example(self) -> Example:
        """Fresh example inputs; equal values on every call."""
        return self.inputs(torch.Generator().manual_seed(0))


# -- reading outputs and losses -------------------------------------------------------------

logits = field("logits")
last_hidden_state = field("last_hidden_state")
pooler_output = field("pooler_output")


# -- inputs ---------------------------------------------------------------------------------


def _ids(gen: torch.Generator, seq: int = SEQ, low: int = 3) -> torch.Tensor:
    """Token ids above the special tokens (0-2 are pad/bos/eos in most configs)."""
    return torch.randint(low, VOCAB, (BATCH, seq), generator=gen)


def _padding_mask(seq: int = SEQ, pad: int = 3) -> torch.Tensor:
    """All ones except the last ``pad`` positions of the second sequence (right padding,
    so no query row of a causal model is fully masked)."""
    mask = torch.ones(BATCH, seq, dtype=torch.long)
    mask[1, seq - pad:] = 0
    return mask


def text_inputs(gen: torch.Generator) -> Example:
    return (_ids(gen),), {"attention_mask": _padding_mask()}


def text_inputs_with_labels(gen: torch.Generator) -> Example:
    ids, mask = _ids(gen), _padding_mask()
    return (ids,), {"attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def seq2seq_inputs(gen: torch.Generator) -> Example:
    ids, decoder_ids = _ids(gen), _ids(gen, seq=SEQ // 2)
    return (ids,), {"attention_mask": _padding_mask(), "decoder_input_ids": decoder_ids}


def image_inputs(size: int = IMAGE) -> Callable[[torch.Generator], Example]:
    """``pixel_values`` by keyword, as ``model(**image_processor(...))`` passes it."""

    def inputs(gen: torch.Generator) -> Example:
        return (), {"pixel_values": torch.randn(BATCH, 3, size, size, generator=gen)}

    return inputs


def whisper_inputs(gen: torch.Generator) -> Example:
    features = torch.randn(BATCH, 16, 16, generator=gen)  # (batch, mel bins, 2 * source pos)
    return (features,), {"decoder_input_ids": _ids(gen, seq=SEQ // 2)}


def audio_inputs(gen: torch.Generator) -> Example:
    samples = 400
    mask = torch.ones(BATCH, samples, dtype=torch.long)
    mask[1, 300:] = 0
    return (torch.randn(BATCH, samples, generator=gen),), {"attention_mask": mask}


# -- configs --------------------------------------------------------------------------------


def _deterministic(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """Zero every dropout, layer drop and drop path rate, and SpecAugment's masking, so that
    train mode computes the same as eval mode's graph and two copies train identically."""
    for key, value in list(config.to_dict().items()):
        if "drop" in key and isinstance(value, float):
            setattr(config, key, 0.0)
    for key in ("mask_time_prob", "mask_feature_prob"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    return config


def _config(cls: type[transformers.PretrainedConfig], attn: str = "eager",
            **kwargs: Any) -> Callable[[], transformers.PretrainedConfig]:
    def build() -> transformers.PretrainedConfig:
        return _deterministic(cls(attn_implementation=attn, **kwargs))

    return build


_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, use_cache=False, tie_word_embeddings=False)
_GQA = dict(_DECODER, num_key_value_heads=1)
_ENCODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=64, pad_token_id=0)
_VIT = dict(image_size=IMAGE, patch_size=8, hidden_size=32, intermediate_size=64,
            num_hidden_layers=1, num_attention_heads=2)
_GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64,
             bos_token_id=0, eos_token_id=0, use_cache=False)
_BART = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
             encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
             decoder_ffn_dim=64, max_position_embeddings=64, use_cache=False)


def _decoder(name: str, config_cls: type[transformers.PretrainedConfig], model_cls: type[nn.Module],
             family: str = "decoder", attn: str = "eager", **kwargs: Any) -> Arch:
    return Arch(name, family, model_cls, _config(config_cls, attn, **kwargs), text_inputs,
                logits, cross_entropy_on(logits))


def _encoder(name: str, config_cls: type[transformers.PretrainedConfig], model_cls: type[nn.Module],
             **kwargs: Any) -> Arch:
    return Arch(name, "encoder", model_cls, _config(config_cls, **kwargs), text_inputs, logits,
                cross_entropy_on(logits))


def _vision(name: str, config_cls: type[transformers.PretrainedConfig], model_cls: type[nn.Module],
            read: Callable[[Any], torch.Tensor] = logits, loss: Callable[[Any], torch.Tensor] | None = None,
            size: int = IMAGE, **kwargs: Any) -> Arch:
    return Arch(name, "vision", model_cls, _config(config_cls, **kwargs), image_inputs(size),
                read, loss or cross_entropy_on(read))


T = transformers

ZOO: tuple[Arch, ...] = (
    # -- decoders ------------------------------------------------------------------------
    _decoder("llama", T.LlamaConfig, T.LlamaForCausalLM, **_GQA),
    _decoder("llama_sdpa", T.LlamaConfig, T.LlamaForCausalLM, attn="sdpa", **_GQA),
    _decoder("mistral", T.MistralConfig, T.MistralForCausalLM, sliding_window=8, **_GQA),
    _decoder("gemma", T.GemmaConfig, T.GemmaForCausalLM, head_dim=16, **_GQA),
    _decoder("gemma2", T.Gemma2Config, T.Gemma2ForCausalLM, head_dim=16, sliding_window=8,
             query_pre_attn_scalar=16, **dict(_GQA, num_hidden_layers=2)),  # sliding, global
    _decoder("qwen2", T.Qwen2Config, T.Qwen2ForCausalLM, **_GQA),
    _decoder("qwen3", T.Qwen3Config, T.Qwen3ForCausalLM, head_dim=16, **_GQA),
    _decoder("phi", T.PhiConfig, T.PhiForCausalLM, partial_rotary_factor=0.5, **_DECODER),
    _decoder("phi3", T.Phi3Config, T.Phi3ForCausalLM, **_DECODER),
    _decoder("falcon", T.FalconConfig, T.FalconForCausalLM, vocab_size=VOCAB, hidden_size=32,
             num_hidden_layers=1, num_attention_heads=2, use_cache=False),
    _decoder("bloom", T.BloomConfig, T.BloomForCausalLM, vocab_size=VOCAB, hidden_size=32,
             n_layer=2, n_head=2, use_cache=False),  # ALiBi position biases
    Arch("opt_cache", "decoder", T.OPTForCausalLM,
         _config(T.OPTConfig, vocab_size=VOCAB, hidden_size=32, word_embed_proj_dim=32,
                 ffn_dim=64, num_hidden_layers=1, num_attention_heads=2,
                 max_position_embeddings=64, use_cache=True),  # returns a DynamicCache
         text_inputs, logits, cross_entropy_on(logits)),
    Arch("gpt2_labels", "decoder", T.GPT2LMHeadModel,
         _config(T.GPT2Config, **_GPT2),
         text_inputs_with_labels, logits, model_loss),  # the loss is computed inside
    Arch("gpt2_ckpt", "decoder", T.GPT2LMHeadModel,
         _config(T.GPT2Config, **dict(_GPT2, n_layer=2)),  # a checkpoint per layer
         text_inputs, logits, cross_entropy_on(logits), gradient_checkpointing=True),
    _decoder("gpt_neox", T.GPTNeoXConfig, T.GPTNeoXForCausalLM, rotary_pct=0.5, **_DECODER),
    # -- mixtures of experts -------------------------------------------------------------
    _decoder("mixtral", T.MixtralConfig, T.MixtralForCausalLM, family="moe",
             num_local_experts=4, num_experts_per_tok=2, **_GQA),
    _decoder("qwen2_moe", T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, family="moe",
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
             shared_expert_intermediate_size=32, **_GQA),
    # -- state-space models --------------------------------------------------------------
    _decoder("mamba", T.MambaConfig, T.MambaForCausalLM, family="ssm", vocab_size=VOCAB,
             hidden_size=32, state_size=8, num_hidden_layers=2, use_cache=False),
    # -- encoders ------------------------------------------------------------------------
    _encoder("bert", T.BertConfig, T.BertForSequenceClassification, num_labels=3, **_ENCODER),
    _encoder("roberta", T.RobertaConfig, T.RobertaForMaskedLM,
             **dict(_ENCODER, pad_token_id=1)),
    _encoder("deberta_v2", T.DebertaV2Config, T.DebertaV2ForSequenceClassification,
             num_labels=3, relative_attention=True, position_buckets=8,
             pos_att_type=["p2c", "c2p"], **_ENCODER),
    _encoder("electra", T.ElectraConfig, T.ElectraForPreTraining, embedding_size=32,
             **_ENCODER),
    _encoder("albert", T.AlbertConfig, T.AlbertForMaskedLM, embedding_size=16,
             **dict(_ENCODER, num_hidden_layers=2)),  # one layer's weights, run twice
    _encoder("distilbert", T.DistilBertConfig, T.DistilBertForSequenceClassification,
             vocab_size=VOCAB, dim=32, hidden_dim=64, n_layers=1, n_heads=2,
             max_position_embeddings=64, num_labels=3),
    # -- encoder-decoders ----------------------------------------------------------------
    Arch("t5", "encoder-decoder", T.T5ForConditionalGeneration,
         _config(T.T5Config, vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                 num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8,
                 use_cache=False),
         seq2seq_inputs, logits, cross_entropy_on(logits)),
    Arch("bart", "encoder-decoder", T.BartForConditionalGeneration, _config(T.BartConfig, **_BART),
         seq2seq_inputs, logits, cross_entropy_on(logits)),
    Arch("whisper", "encoder-decoder", T.WhisperForConditionalGeneration,
         _config(T.WhisperConfig, **dict(_BART, num_mel_bins=16, max_source_positions=8,
                                         max_target_positions=16, pad_token_id=0,
                                         bos_token_id=1, eos_token_id=2,
                                         decoder_start_token_id=1, suppress_tokens=None,
                                         begin_suppress_tokens=None)),
         whisper_inputs, logits, cross_entropy_on(logits)),
    # -- audio ---------------------------------------------------------------------------
    Arch("wav2vec2", "audio", T.Wav2Vec2ForCTC,
         _config(T.Wav2Vec2Config, vocab_size=32, hidden_size=32, num_hidden_layers=2,
                 num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
                 conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=8,
                 num_conv_pos_embedding_groups=2, feat_extract_norm="layer",
                 do_stable_layer_norm=True),  # the large-model layout, which takes a mask
         audio_inputs, logits, cross_entropy_on(logits)),
    # -- vision --------------------------------------------------------------------------
    _vision("vit", T.ViTConfig, T.ViTForImageClassification, num_labels=4, **_VIT),
    _vision("beit", T.BeitConfig, T.BeitForImageClassification, num_labels=4,
            use_relative_position_bias=True, **_VIT),
    # 48x48 inputs on a 32x32 config: position embeddings are interpolated (bicubic)
    _vision("dinov2", T.Dinov2Config, T.Dinov2Model, read=last_hidden_state,
            loss=mean_square_of(last_hidden_state), size=48,
            **dict(_VIT, num_hidden_layers=2)),
    _vision("clip_vision", T.CLIPVisionConfig, T.CLIPVisionModel, read=pooler_output,
            loss=mean_square_of(pooler_output), **_VIT),
    _vision("siglip_vision", T.SiglipVisionConfig, T.SiglipVisionModel, read=pooler_output,
            loss=mean_square_of(pooler_output), **_VIT),  # attention-pooling head
    _vision("swin", T.SwinConfig, T.SwinForImageClassification, image_size=IMAGE, patch_size=2,
            embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, num_labels=4),
    _vision("convnext", T.ConvNextConfig, T.ConvNextForImageClassification,
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=4),
    _vision("resnet", T.ResNetConfig, T.ResNetForImageClassification, embedding_size=16,
            hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=4),
    _vision("mobilevit", T.MobileViTConfig, T.MobileViTForImageClassification,
            image_size=IMAGE, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
            expand_ratio=2.0, num_attention_heads=2, num_labels=4),
    _vision("segformer", T.SegformerConfig, T.SegformerForSemanticSegmentation,
            num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
            patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
            decoder_hidden_size=32, num_labels=4, loss=cross_entropy_on(logits, class_dim=1)),
)

_BY_NAME = {a.name: a for a in ZOO}
assert len(_BY_NAME) == len(ZOO), "architecture names must be unique"
assert all(a.family in FAMILIES for a in ZOO)


def arch(name: str) -> Arch:
    """The zoo entry called ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"no architecture {name!r} in the zoo; known: {', '.join(_BY_NAME)}") from None

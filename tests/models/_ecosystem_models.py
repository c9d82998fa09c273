"""How each model of the ecosystem zoo (``_ecosystem_zoo.py``) is built: one function per
model, named as the zoo names it, with the library's own classes and builders in a tiny
configuration (``weights=None``, ``pretrained=False``: nothing is downloaded).

Each function imports its library, so that importing this module imports none. Every dropout
and drop-path rate is 0, so train mode is deterministic.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["CLASSES", "IMAGE_TOKEN", "PATCHES", "VOCAB", "tv_resnet", "tv_mobilenet_v3",
           "tv_efficientnet", "tv_convnext", "tv_regnet", "tv_shufflenet",
           "tv_densenet", "tv_vit", "tv_swin", "tv_googlenet", "tv_lraspp",
           "tv_video_resnet", "tv_mvit", "tv_raft", "timm_vit", "timm_eva",
           "timm_convnext", "timm_resnet", "timm_efficientnet", "timm_mixer",
           "timm_nfnet", "timm_coatnet", "timm_levit", "timm_efficientformerv2",
           "timm_poolformer", "timm_swin", "timm_ghostnetv2", "timm_sequencer2d",
           "diffusers_unet", "diffusers_vae", "diffusers_dit", "diffusers_sd3",
           "hf_clip", "hf_llava"]

CLASSES = 4

VOCAB = 128
IMAGE_TOKEN = VOCAB - 1
PATCHES = (32 // 8) ** 2
"""Image tokens per image: the vision towers cut 32x32 images into 8x8 patches."""


def _timm(name: str, **kwargs: Any) -> nn.Module:
    import timm

    return timm.create_model(name, pretrained=False, num_classes=CLASSES, **kwargs)


def tv_resnet() -> nn.Module:
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=CLASSES)  # stage widths are fixed


def _mobilenet_v3() -> nn.Module:
    # Four blocks in MobileNetV3's notation: squeeze-excitation, ReLU and hard-swish, strides
    # of 2 (the "C" blocks LRASPP takes its features from) and a residual block.
    from torchvision.models.mobilenetv3 import InvertedResidualConfig, MobileNetV3

    blocks = [InvertedResidualConfig(*args, dilation=1, width_mult=1.0) for args in (
        (16, 3, 16, 16, True, "RE", 2), (16, 3, 32, 24, False, "RE", 2),
        (24, 5, 48, 24, True, "HS", 1), (24, 5, 64, 32, True, "HS", 2))]
    return MobileNetV3(blocks, last_channel=64, num_classes=CLASSES, dropout=0.0)


def tv_mobilenet_v3() -> nn.Module:
    return _mobilenet_v3()


def tv_efficientnet() -> nn.Module:
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    blocks = [MBConvConfig(*args) for args in (  # expansion, kernel, stride, in, out, layers
        (1, 3, 1, 16, 8, 1), (6, 3, 2, 8, 16, 1), (6, 5, 2, 16, 24, 1))]
    return EfficientNet(blocks, dropout=0.0, stochastic_depth_prob=0.0, num_classes=CLASSES,
                        last_channel=64)


def tv_convnext() -> nn.Module:
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    return ConvNeXt([CNBlockConfig(16, 32, 1), CNBlockConfig(32, None, 1)],
                    stochastic_depth_prob=0.0, num_classes=CLASSES)


def tv_regnet() -> nn.Module:
    from torchvision.models.regnet import BlockParams, RegNet

    return RegNet(BlockParams.from_init_params(depth=4, w_0=16, w_a=8.0, w_m=2.0, group_width=8),
                  num_classes=CLASSES)


def tv_shufflenet() -> nn.Module:
    from torchvision.models.shufflenetv2 import ShuffleNetV2

    return ShuffleNetV2([1, 1, 1], [8, 16, 32, 64, 128], num_classes=CLASSES)


def tv_densenet() -> nn.Module:
    from torchvision.models.densenet import DenseNet

    return DenseNet(growth_rate=8, block_config=(1, 1), num_init_features=16, bn_size=2,
                    num_classes=CLASSES)


def tv_vit() -> nn.Module:
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                             hidden_dim=32, mlp_dim=64, num_classes=CLASSES)


def tv_swin() -> nn.Module:
    from torchvision.models.swin_transformer import SwinTransformer

    return SwinTransformer(patch_size=[2, 2], embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                           window_size=[4, 4], stochastic_depth_prob=0.0, num_classes=CLASSES)


def tv_googlenet() -> nn.Module:
    from torchvision.models.googlenet import GoogLeNet

    return GoogLeNet(num_classes=CLASSES, aux_logits=False, init_weights=True, dropout=0.0)


def tv_lraspp() -> nn.Module:
    # What lraspp_mobilenet_v3_large builds, on the four-block MobileNetV3 above.
    from torchvision.models.segmentation.lraspp import _lraspp_mobilenetv3

    return _lraspp_mobilenetv3(_mobilenet_v3(), CLASSES)


def tv_video_resnet() -> nn.Module:
    # MC3's layout (3D convolutions in the first stage, 2D ones after) with one block per
    # stage: torchvision's video ResNets have fixed stage widths (64-512).
    from torchvision.models.video.resnet import (BasicBlock, BasicStem, Conv3DNoTemporal,
                                                 Conv3DSimple, VideoResNet)

    return VideoResNet(BasicBlock, [Conv3DSimple] + [Conv3DNoTemporal] * 3, [1, 1, 1, 1],
                       BasicStem, num_classes=CLASSES)


def tv_mvit() -> nn.Module:
    from torchvision.models.video.mvit import MSBlockConfig, MViT

    def block(heads: int, width_in: int, width_out: int, stride_q: list[int],
              stride_kv: list[int]) -> MSBlockConfig:
        return MSBlockConfig(num_heads=heads, input_channels=width_in, output_channels=width_out,
                             kernel_q=[3, 3, 3], kernel_kv=[3, 3, 3], stride_q=stride_q,
                             stride_kv=stride_kv)

    return MViT(spatial_size=(16, 16), temporal_size=4,
                block_setting=[block(1, 16, 16, [1, 1, 1], [1, 2, 2]),
                               block(2, 16, 32, [1, 2, 2], [1, 1, 1])],
                residual_pool=True, residual_with_cls_embed=False, rel_pos_embed=True,
                proj_after_attn=True, stochastic_depth_prob=0.0, dropout=0.0,
                attention_dropout=0.0, num_classes=CLASSES,
                patch_embed_kernel=(3, 7, 7), patch_embed_stride=(2, 4, 4),
                patch_embed_padding=(1, 3, 3))


def tv_raft() -> nn.Module:
    # raft_small with a 2-level correlation pyramid (4 levels need 128x128 frames).
    import torchvision
    from torchvision.models.optical_flow.raft import CorrBlock

    return torchvision.models.optical_flow.raft_small(
        weights=None, corr_block=CorrBlock(num_levels=2, radius=2))


def timm_vit() -> nn.Module:
    return _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                 num_heads=2)


def timm_eva() -> nn.Module:  # rotary position embeddings, SwiGLU
    return _timm("eva02_tiny_patch14_224", img_size=32, patch_size=8, embed_dim=32, depth=2,
                 num_heads=2)


def timm_convnext() -> nn.Module:
    return _timm("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32))


def timm_resnet() -> nn.Module:
    return _timm("resnet18", layers=(1, 1, 1, 1), channels=(16, 32, 64, 128))


def timm_efficientnet() -> nn.Module:
    from timm.models.efficientnet import _gen_efficientnet

    return _gen_efficientnet("efficientnet_b0", channel_multiplier=0.25, depth_multiplier=0.25,
                             pretrained=False, num_classes=CLASSES)


def timm_mixer() -> nn.Module:
    from timm.models.mlp_mixer import MlpMixer

    return MlpMixer(num_classes=CLASSES, img_size=32, patch_size=8, num_blocks=2, embed_dim=32)


def timm_nfnet() -> nn.Module:  # scaled weight standardisation instead of normalisation
    from timm.models.nfnet import NfCfg, NormFreeNet

    return NormFreeNet(NfCfg(depths=(1, 1, 1, 1), channels=(16, 32, 64, 128), stem_chs=16,
                             group_size=8, extra_conv=True, gamma_in_act=True,
                             act_layer="gelu", attn_layer="se", attn_kwargs=dict(rd_ratio=0.5),
                             num_features=128), num_classes=CLASSES)


def timm_coatnet() -> nn.Module:
    from timm.models.maxxvit import MaxxVit, MaxxVitCfg, MaxxVitTransformerCfg

    return MaxxVit(MaxxVitCfg(embed_dim=(16, 32, 32, 64), depths=(1, 1, 1, 1),
                              block_type=("C", "C", "T", "T"), stem_width=16,
                              transformer_cfg=MaxxVitTransformerCfg(dim_head=16)),
                   img_size=64, num_classes=CLASSES)


def timm_levit() -> nn.Module:
    from timm.models.levit import Levit

    return Levit(img_size=64, embed_dim=(16, 32), key_dim=8, depth=(1, 1), num_heads=(2, 2),
                 num_classes=CLASSES)


def timm_efficientformerv2() -> nn.Module:
    from timm.models.efficientformer_v2 import EfficientFormerV2

    return EfficientFormerV2(depths=(1, 1, 1, 1), embed_dims=(8, 16, 24, 32), num_vit=1,
                             mlp_ratios=2, distillation=False, img_size=64, num_classes=CLASSES)


def timm_poolformer() -> nn.Module:
    from timm.models.metaformer import GroupNorm1NoBias, MetaFormer

    return MetaFormer(depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), norm_layers=GroupNorm1NoBias,
                      use_mlp_head=False, num_classes=CLASSES)


def timm_swin() -> nn.Module:
    return _timm("swin_tiny_patch4_window7_224", img_size=32, window_size=4, embed_dim=16,
                 depths=(1, 1), num_heads=(2, 2), drop_path_rate=0.0)


def timm_ghostnetv2() -> nn.Module:
    from timm.models.ghostnet import _create_ghostnet

    return _create_ghostnet("ghostnetv2_100", width=0.25, version="v2", drop_rate=0.0,
                            num_classes=CLASSES)


def timm_sequencer2d() -> nn.Module:  # bidirectional LSTMs over rows and columns
    from timm.models.sequencer import Sequencer2d

    return Sequencer2d(num_classes=CLASSES, img_size=32, layers=(1, 1), patch_sizes=(4, 2),
                       embed_dims=(16, 32), hidden_sizes=(8, 16), mlp_ratios=(2.0, 2.0))


def diffusers_unet() -> nn.Module:  # Stable Diffusion's layout: cross-attention to text
    from diffusers import UNet2DConditionModel

    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16, 32), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=8)


def diffusers_vae() -> nn.Module:
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
        layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=32)


def diffusers_dit() -> nn.Module:  # class-conditional, adaptive layer norm
    from diffusers import DiTTransformer2DModel
    from diffusers.models.embeddings import LabelEmbedding

    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                  out_channels=4, num_layers=2, sample_size=8, patch_size=2,
                                  num_embeds_ada_norm=10, norm_num_groups=8)
    for module in model.modules():
        if isinstance(module, LabelEmbedding):  # classifier-free guidance's label dropout (10%)
            module.dropout_prob = 0.0
    return model


def diffusers_sd3() -> nn.Module:  # joint text-image attention (MMDiT)
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2,
                                 attention_head_dim=8, num_attention_heads=2,
                                 joint_attention_dim=32, caption_projection_dim=16,
                                 pooled_projection_dim=16, out_channels=4, pos_embed_max_size=16)


def hf_clip() -> nn.Module:
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    vision = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=2)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.CLIPModel(config)


def hf_llava() -> nn.Module:
    import transformers

    vision = transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=32,
                                           intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=2)
    text = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=64,
                                    pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                    use_cache=False, tie_word_embeddings=False)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                      image_token_index=IMAGE_TOKEN, vision_feature_layer=-1,
                                      vision_feature_select_strategy="default")
    return transformers.LlavaForConditionalGeneration(config)

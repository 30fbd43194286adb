"""lingc.ir.text: graphs print as Python, one node per line, with dtype[shape] and pass annotations in comments."""

from __future__ import annotations

from lingc.ir.text import graph_text, program_text
from lingc.passes.manager import PassManager


def line_of(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(f"{name} ="))


def test_graph_text_shows_shapes_and_dtypes(tiny_program, tiny_program_bf16):
    text = graph_text("decode", tiny_program.graphs["decode"])
    assert text.startswith("def decode(\n    input_ids: i64[1,1],\n    positions: i64[1,1],\n    slots: i32[1],\n"
                           "    page_table: i32[2,3],\n")
    assert "    state_layers_3_kv_pages: f32[7,16,80],\n" in text                   # 2 slots x 3 pages + 1
    assert line_of(text, "model_embedding") == \
        "    model_embedding = lingc.embedding(input_ids, w_model_word_embeddings_weight)  # f32[1,1,128]"
    assert line_of(text, "L1_mlp_router_topk").endswith("# (f32[1,4], i32[1,4])")      # multi-output op
    assert line_of(text, "L1_mlp_moe_up").endswith("4, 16)  # f32[4,128]")
    assert line_of(text, "L3_attention_squeeze").startswith("    L3_attention_squeeze = aten.squeeze.dim(")
    assert line_of(text, "w_lm_head_weight") == "    w_lm_head_weight = weight['lm_head.weight']  # f32[512,128]"
    assert text.rstrip().endswith("return [lm_head_linear, norm_rmsnorm]")
    bf16 = graph_text("decode", tiny_program_bf16.graphs["decode"])
    assert line_of(bf16, "model_embedding").endswith("# bf16[1,1,128]")
    assert line_of(bf16, "lm_head_linear").endswith("# f32[1,1,512]")             # the head returns fp32 logits


def test_pass_annotations_and_weight_info_print(tiny_program):
    program = PassManager(["all"]).run(tiny_program).program
    text = graph_text("decode", program.graphs["decode"], program.weight_info)
    # fuse_moe_align put the align inside router_align, which ends the router chain; the MoE chain starts at the up-GEMM
    # (layer 3 keeps its shared expert; layer 1's is expert 16 after fuse_shared_expert: 4 + 1 pairs)
    assert line_of(text, "L3_mlp_moe_up_act").endswith("# f32[4,64]  pdl=moe@L3 1/3 layout=gu_interleaved")
    assert line_of(text, "L1_mlp_moe_up_act").endswith(
        "# f32[5,64]  pdl=moe@L1 1/3 layout=gu_interleaved launch=shared_last")
    # pdl's entry triggers: the KDA o_norm before o_proj, MLA attention before the dense, and the linear told so
    assert line_of(text, "L0_attention_gated_rmsnorm").endswith("launch=entry_trigger")
    assert line_of(text, "L0_attention_o_proj_linear").endswith("launch=launched_early")
    assert line_of(text, "L4_attention_mla_attention").endswith("launch=entry_trigger")
    # fuse_norm_linear runs the post-attention norm inside the gate's GEMV: the router chain is norm+gate -> align
    assert line_of(text, "L3_mlp_router_align").endswith("pdl=router@L3 2/2 early")
    assert line_of(text, "L3_post_attention_layernorm_add_rmsnorm_linear").endswith(
        "# (f32[1,1,16], f32[1,1,128], f32[1,1,128])  pdl=router@L3 1/2 dtype=bf16")
    assert line_of(text, "w_L3_mlp_experts_w13_interleaved").endswith("# f32[16,128,128] layout=gu_interleaved")
    fused_w13 = line_of(text, "w_L1_mlp_experts_w13_interleaved_with_shared")
    assert "# f32[17,128,128] concat_of=" in fused_w13 and fused_w13.endswith("layout=gu_interleaved shared_expert=16")
    assert line_of(text, "w_L0_attention_fused_qkvfbg_weight").endswith(
        "# f32[644,128] fused_from=['model.layers.0.attention.q_proj.weight', 'model.layers.0.attention.k_proj.weight', "
        "'model.layers.0.attention.v_proj.weight', 'model.layers.0.attention.f_proj.weight', "
        "'model.layers.0.attention.b_proj.weight', 'model.layers.0.attention.g_proj.weight'] "
        "split=[128, 128, 128, 128, 4, 128]")


def test_program_text_orders_graphs_under_the_header(tiny_program):
    text = program_text(tiny_program, "# stage 00: traced")
    assert text.startswith("# stage 00: traced\n\ndef decode(")
    defs = [line.split("(")[0] for line in text.splitlines() if line.startswith("def ")]
    assert defs == ["def decode", "def mtp_decode", "def mtp_prefill", "def nextn", "def prefill", "def step"]
    assert program_text(tiny_program) == program_text(tiny_program.copy())      # copy() keeps names and meta

"""lingc passes: one file per pass, registered here by the name users type (`--passes fuse_swiglu,pdl`)."""

from lingc.passes.base import Pass, PassRecord
from lingc.passes.bf16_router import Bf16Router
from lingc.passes.draft_vocab import DraftVocab
from lingc.passes.capture_metadata import CaptureMetadata
from lingc.passes.fuse_add_norm import FuseAddNorm
from lingc.passes.fuse_cat_norm import FuseCatNorm
from lingc.passes.fuse_align_into_moe import FuseAlignIntoMoe
from lingc.passes.fuse_all_reduce_norm import FuseAllReduceNorm
from lingc.passes.fuse_combine_norm import FuseCombineNorm
from lingc.passes.fuse_embed_norm import FuseEmbedNorm
from lingc.passes.fuse_emit import FuseEmit
from lingc.passes.fuse_index_chains import FuseIndexChains
from lingc.passes.fuse_kda import FuseKda
from lingc.passes.fuse_mla import FuseMla
from lingc.passes.fuse_moe import FuseMoe
from lingc.passes.fuse_moe_align import FuseMoeAlign
from lingc.passes.fuse_norm_linear import FuseNormLinear
from lingc.passes.fuse_norm_router import FuseNormRouter
from lingc.passes.fuse_projections import FuseProjections
from lingc.passes.fuse_relay import FuseRelay
from lingc.passes.fuse_relay_cat import FuseRelayCat
from lingc.passes.fuse_router_into_moe import FuseRouterIntoMoe
from lingc.passes.fuse_shared_expert import FuseSharedExpert
from lingc.passes.fuse_simulate_accept import FuseSimulateAccept
from lingc.passes.fuse_swiglu import FuseSwiglu
from lingc.passes.partition import Partition
from lingc.passes.pdl import Pdl
from lingc.passes.prefetch_weights import PrefetchWeights
from lingc.passes.specialize_greedy import SpecializeGreedy
from lingc.passes.specialize_sampling import SpecializeSampling
from lingc.passes.tp import TensorParallel

PASSES: dict[str, type[Pass]] = {p.name: p for p in (SpecializeGreedy, SpecializeSampling, Partition, FuseSwiglu,
                                                     FuseIndexChains, CaptureMetadata, Bf16Router, FuseProjections,
                                                     FuseAddNorm, FuseMoeAlign, FuseSharedExpert, FuseMoe, FuseKda,
                                                     FuseNormLinear, FuseCombineNorm, FuseMla, FuseRelay, FuseRelayCat,
                                                     FuseEmit, FuseSimulateAccept, FuseCatNorm, FuseEmbedNorm,
                                                     FuseAlignIntoMoe, FuseRouterIntoMoe, DraftVocab, FuseNormRouter, Pdl,
                                                     PrefetchWeights)}
# passes that run only through their own flag, never through --passes or `all`: `tp` (compile --tp N) runs
# after every pass above, with the degree as its argument, then fuse_all_reduce_norm on the all_reduces it
# inserted (lingc.passes.tp.run_tp_stage)
EXPLICIT_PASSES: dict[str, type[Pass]] = {TensorParallel.name: TensorParallel,
                                          FuseAllReduceNorm.name: FuseAllReduceNorm}

__all__ = ["EXPLICIT_PASSES", "PASSES", "Pass", "PassRecord"]

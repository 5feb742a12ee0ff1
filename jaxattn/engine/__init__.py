"""Serving engine: continuous batching over the paged KV pool and the radix prefix cache."""

from .calibrate import calibrate_kv_scales
from .config import KV_DTYPES, Buckets, CacheConfig, ExecutionConfig, SchedulerConfig, bucket
from .engine import Engine, RequestError
from .kv_cache import KVCacheManager, PrefixMatch
from .model import CausalLM
from .progress import ProgressBar
from .runner import DecodeRows, ModelRunner, StepOutput, StepWork
from .sampling import sample, sample_keys
from .scheduler import Chunk, Decode, Scheduler, Sequence, StepPlan
from .stats import StatsCollector
from .verify import VerifyReport, check_outputs, dense_logits

__all__ = [
    "KV_DTYPES",
    "Buckets",
    "CacheConfig",
    "CausalLM",
    "Chunk",
    "Decode",
    "DecodeRows",
    "Engine",
    "ExecutionConfig",
    "KVCacheManager",
    "ModelRunner",
    "PrefixMatch",
    "ProgressBar",
    "RequestError",
    "Scheduler",
    "SchedulerConfig",
    "Sequence",
    "StatsCollector",
    "StepOutput",
    "StepPlan",
    "StepWork",
    "VerifyReport",
    "bucket",
    "calibrate_kv_scales",
    "check_outputs",
    "dense_logits",
    "sample",
    "sample_keys",
]

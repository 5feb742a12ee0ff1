"""Serving engine: continuous batching over the paged KV pool and the radix prefix cache."""

from .engine import Engine, RequestError
from .pool import PagePool
from .progress import ProgressBar
from .runner import Buckets, ModelRunner, bucket
from .sampling import sample, sample_keys
from .scheduler import Scheduler, Sequence, StepPlan
from .verify import VerifyReport, check_outputs, dense_logits

__all__ = [
    "Buckets",
    "Engine",
    "ModelRunner",
    "PagePool",
    "RequestError",
    "ProgressBar",
    "Scheduler",
    "Sequence",
    "StepPlan",
    "VerifyReport",
    "bucket",
    "check_outputs",
    "dense_logits",
    "sample",
    "sample_keys",
]

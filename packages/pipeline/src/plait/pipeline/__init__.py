"""Pipeline parallel: split a decoder into stages, parallelize each with the sidecar flow, schedule them."""

from plait.pipeline.config import PipelineConfig
from plait.pipeline.pipeline import Pipeline, pipeline_model
from plait.pipeline.schedules import SCHEDULES
from plait.pipeline.split import DecoderParts, StageSpec, find_decoder_parts, plan_stages

__all__ = [
    "SCHEDULES",
    "DecoderParts",
    "Pipeline",
    "PipelineConfig",
    "StageSpec",
    "find_decoder_parts",
    "pipeline_model",
    "plan_stages",
]

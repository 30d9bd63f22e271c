"""The prompt stage of a job as a run builds it: with the context length the run resolves
(`dlbatch.driver.config.RunConfig`), so a test's prompts are cut as the workers' would be."""
from __future__ import annotations


def prompt_stage(spec, skip_doc_ids=None, map_reduce: bool = False):
    """`PromptStage` of job ``spec`` given the run's resolved ``max_model_len``."""
    from dlbatch.driver.config import RunConfig
    from dlbatch.prompts.stage import PromptStage

    return PromptStage(spec, skip_doc_ids, map_reduce, max_model_len=RunConfig.resolve(spec).max_model_len)

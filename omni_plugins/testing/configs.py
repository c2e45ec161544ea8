"""A sample pipeline YAML that exercises most of the loader: seeds for fuzzers and tests."""

SAMPLE_PIPELINE_YAML = """\
connectors:
  fast: {name: memory, extra: {namespace: "${NS:-pipeline}"}}
  other: {name: memory}
default_connector: fast
stages:
  - stage_id: 0
    worker_type: ar
    model_stage: thinker
    custom_process_next_stage_input_func: omni_plugins.testing.builders.passthrough
    output_connectors: {to_stage_1: fast}
    rank_mapping: {from_tp: 2, to_tp: 1}
  - stage_id: 1
    async_chunk: true
    worker_type: generation
    recv_timeout_s: 30
    input_connectors: {from_stage_0: fast}
    output_connectors: {to_stage_2: other}
  - {stage_id: 2, final_output: true, input_connectors: {from_stage_1: other}}
"""

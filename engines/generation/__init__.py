"""Generation engines (HF, vLLM), the continuous router and its request streams, the rollout scheduler, partial rollout."""

"""What the stages share across iterations: the iteration recipe, the prompt stream, the carried partial-rollout pool, the publish plan, live sync, request streams."""

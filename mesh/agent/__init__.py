"""The coordinator as an agent: plan a task on the pool (:mod:`.plans`), delegate its
subtasks to workers (:mod:`.task`), synthesize one answer
(:mod:`.synthesis`), remember a context's earlier turns (:mod:`.history`). Knows nothing of
the A2A server around it."""

"""Token-level correction annotation (onPanda's locate -> correct -> continue loop), docs/annotate.md.

- model.py      the model side: `ModelBackend` (score a response, top-k per token, continue from a token
                prefix, streamed); `LocalModel` runs any Hugging Face causal LM (and shoal.train.repro's
                checkpoints) on CPU; `OpenAIModel` is a client of an OpenAI-compatible /v1/completions,
                `OpenAIChatModel` of its /v1/chat/completions (assistant-prefilled continuation)
- tokens.py     the model's own tokenizer, with exact per-token bytes (multi-byte characters split
                across tokens stay exact)
- tree.py       the annotation tree (every operation a node) in SQLite or PostgreSQL, optimistic versions
- export.py     SFT, preference pairs (fork + outcome, TRL DPO format), token-level supervision,
                find-and-replace correction pairs
- agent.py      an episode step's corrected tool call run in a branch of the episode (rollout.branch), in a
                real sandbox; the model then continues after the real output
- app.py        `shoal annotate serve`: the FastAPI app and its keyboard-first page
"""

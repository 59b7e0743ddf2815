"""`python -m chunkserve.replicas.engine`: the engine's command line (llm_engine.main)."""

from chunkserve.replicas.engine.llm_engine import main

main()

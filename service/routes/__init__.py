"""One router per resource: health (health, readiness, info, metrics), models (control API),
repository (Triton's repository extension over it), generate (TGI) and chat (OpenAI)."""

"""One router per resource: health (health, readiness, info, metrics), models (control API),
generate (TGI) and chat (OpenAI)."""

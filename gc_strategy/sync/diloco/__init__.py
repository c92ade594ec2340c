"""DiLoCo and Streaming DiLoCo: local inner steps, then a compressed outer step."""

"""The main job: conversations (or token ids) → EAGLE-3 training files, resumable and self-describing."""

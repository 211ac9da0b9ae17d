"""megarl."""

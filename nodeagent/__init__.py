"""nodeagent package."""

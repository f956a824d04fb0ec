"""Adapters: how each diffusion library's classes are patched. Nothing about matching lives here."""

"""The building blocks every architecture is made of: projections, norms, embeddings."""

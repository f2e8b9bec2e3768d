"""Reading and writing models: files on disk, loading, exporting, example inputs."""

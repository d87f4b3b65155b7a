"""The wire between HTTP workers and the engine process: frames, engine side, worker side."""

"""What runs inside vLLM's workers and around them to capture the residual stream: the decoder contract resolved per
model family (`resolver`, `families`), the worker-side capture (`worker`), the hand-over of states to the driver
(`handover`) and the handshake that checks both sides agree (`handshake`)."""

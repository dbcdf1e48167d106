"""kvserve replicas on Ray Serve: N engines behind one ingress, routed by what each has cached."""

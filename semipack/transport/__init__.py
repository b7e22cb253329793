"""Transport: how messages travel. The backward driver (seeds, the pass, results on the
leaves, rollback), the torch-function mode active inside ``extend`` (interception), hooks
that show user code regular gradients, and the pass counter."""

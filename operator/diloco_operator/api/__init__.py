"""The DilocoJob and LearnerUnit API: the pydantic models, their conditions, and the CRDs generated from them."""

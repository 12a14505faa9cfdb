"""The registered model's code, logged as an MLflow "model from code": MLflow runs this file to
load the model (no pickled Python object, so no CloudPickle at logging or loading). The
Stoker modules it imports travel with the model (``code_paths``: ``stoker.tracking.model_code``)."""

from mlflow.models import set_model

from stoker.tracking.pyfunc import ImageClassifier

set_model(ImageClassifier())

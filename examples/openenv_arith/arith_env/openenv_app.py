"""The same environment served by openenv-core's own server (`pip install openenv-arith[openenv]`):

    uvicorn arith_env.openenv_app:app --port 8000

openenv-core wants its own base classes; these subclasses add nothing else.
"""

from __future__ import annotations

from openenv.core.env_server import Action, Environment, Observation, State, create_app

from arith_env.env import ArithAction, ArithEnvironment, ArithObservation, ArithState


class OpenEnvArithAction(Action, ArithAction):
    pass


class OpenEnvArithObservation(Observation, ArithObservation):
    pass


class OpenEnvArithState(State, ArithState):
    pass


class OpenEnvArithEnvironment(ArithEnvironment, Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        Environment.__init__(self)
        ArithEnvironment.__init__(self)

    def reset(self, seed=None, episode_id=None, **kwargs):  # noqa: ANN001, ANN201
        return OpenEnvArithObservation(**ArithEnvironment.reset(self, seed, episode_id).model_dump())

    def step(self, action, timeout_s=None, **kwargs):  # noqa: ANN001, ANN201
        return OpenEnvArithObservation(**ArithEnvironment.step(self, action, timeout_s).model_dump())

    @property
    def state(self) -> OpenEnvArithState:
        return OpenEnvArithState(**self._state.model_dump())


app = create_app(OpenEnvArithEnvironment, OpenEnvArithAction, OpenEnvArithObservation, env_name="arith_env",
                 max_concurrent_envs=64)

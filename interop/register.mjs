// wukongimjssdk 1.0.4 ships ESM with extensionless relative imports, which Node's
// resolver refuses. This hook retries a failing relative specifier with `.js`
// (and `/index.js` for directories).
import { register } from 'node:module';

register('./resolve-hook.mjs', import.meta.url);
